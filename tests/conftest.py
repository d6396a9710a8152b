"""Shared fixtures: tiny models built in the test, the bundled real stories260K, and the checks of a refused
conversion (one error line, nothing written, the source untouched)."""

from __future__ import annotations

import hashlib
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
                        **{"tie_word_embeddings": False, **extra})
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


# --- refused conversions ----------------------------------------------------------------------------------


RANK = ["--rank", "16", "--rope-dim", "8", "--no-verify"]  # head_dim 16 in every tiny model here


def cli(*args: str | Path):
    """``mlaconv convert --quiet``: what is left on stderr is errors and warnings."""
    from typer.testing import CliRunner

    from mlaconv.cli import app

    return CliRunner().invoke(app, ["convert", "--quiet", *map(str, args)])


def hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path (so a new or missing file shows too)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f".{out.name}.mlaconv-*"))


def assert_refused(result, out: Path, source: Path | None = None, before: dict | None = None,
                   match: str = "") -> str:
    """Non-zero exit, one ``error:`` line and no traceback, no OUT, no temporary, the source unchanged."""
    assert result.exit_code not in (0, None), result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert match.lower() in lines[0].lower(), lines[0]
    assert not out.exists()
    assert leftovers(out) == []
    if source is not None:
        assert hashes(source) == before
    return lines[0]


@pytest.fixture
def src(tmp_path) -> Path:
    """A small random Llama (head_dim 16) for the refusal tests."""
    return make_model(tmp_path / "src", heads=4, kv_heads=2, hidden=32, head_dim=16)
