"""The output: a dense DeepSeek-V3 checkpoint and what serves it.

``deepseek``: the format (config, attention tensor names, reading a converted layer back); ``layout``: writing the
output's tensors in order; ``targets``: the serving targets a conversion writes for; ``engines``: what each serving
engine computes from a checkpoint; ``serving``: the report's serving notes; ``absorb``: absorbed inference weights;
``gguf``: the llama.cpp export; ``model_card``: the output's README.
"""
