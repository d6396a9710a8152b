"""mlaconv: convert MHA/GQA checkpoints into native DeepSeek-V3 Multi-head Latent Attention checkpoints."""

__version__ = "0.1.0"
