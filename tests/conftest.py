"""Shared fixtures: tiny models built in the test, and the bundled real stories260K."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "examples" / "stories260K"


def make_model(path: Path, family: str = "llama", *, heads: int = 4, kv_heads: int = 2, hidden: int = 64,
               head_dim: int | None = None, layers: int = 2, eps: float = 1e-6, vocab: int = 96,
               seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 0.2, **extra) -> Path:
    """Save a random model of the given family (weights ~ N(0, scale), norms around 1) to ``path``."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = classes[family]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads,
                        head_dim=head_dim or hidden // heads, rms_norm_eps=eps, max_position_embeddings=256,
                        tie_word_embeddings=False, **extra)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, scale)
    model.to(dtype).save_pretrained(path)
    return path


@pytest.fixture
def tiny_model(tmp_path):
    def build(name: str = "src", **kwargs) -> Path:
        return make_model(tmp_path / name, **kwargs)

    return build


@pytest.fixture(scope="session")
def stories() -> Path:
    return STORIES
