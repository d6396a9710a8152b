"""The bench's baseline converters: stock-loadable, exact where the factorization loses nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers import logits, rel_err
from mlaconv.conversion.plan import plan_shapes
from mlaconv.mla.layer import AttentionShape
from mlaconv.source.spec import load_source

from bench.baselines.methods import augmented, convert_joint_svd, convert_transmla, rorope_basis  # noqa: E402

TOKENS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
CALIB = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(2))
METHODS = ["joint-svd", "transmla"]


def run(method: str, src: Path, out: Path, freqfold: int | None = 1, **shapes) -> dict:
    """One baseline; TransMLA without folding unless asked (its auto search may pick a lossy fold on random weights)."""
    if method == "joint-svd":
        return convert_joint_svd(src, out, **shapes)
    return convert_transmla(src, out, CALIB, freqfold=freqfold, **shapes)


def edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    state = load_file(path)
    for name in list(state):
        state[name] = edit(name, state[name])
    save_file(state, path, metadata={"format": "pt"})


def identical_kv_heads(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Two KV heads, the second key (and key bias) a copy of the first: one shared rotated key carries both."""
    if "k_proj" not in name:
        return tensor
    head = tensor[: tensor.shape[0] // 2]
    return torch.cat([head, head])


@pytest.mark.parametrize("method", METHODS)
def test_mqa_full_rank_loads_as_deepseek_and_is_exact(tiny_model, tmp_path, method):
    src = tiny_model(kv_heads=1, head_dim=16, eps=1e-5)  # ε 1e-5 also exercises the residual rescale
    report = run(method, src, tmp_path / "out", rank=16, rope_dim=16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["rms_norm_eps"]) == (16, 16, 1e-6)
    assert json.loads((tmp_path / "out" / "baseline.json").read_text())["method"] == method == report["method"]
    assert rel_err(logits(tmp_path / "out", TOKENS), logits(src, TOKENS)) <= 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_gqa_expansion_is_exact_when_one_key_serves_all_heads(tiny_model, tmp_path, method):
    src = tiny_model(heads=4, kv_heads=2, head_dim=16)
    edit_weights(src, identical_kv_heads)
    run(method, src, tmp_path / "out", rank=48, rope_dim=16)
    assert rel_err(logits(tmp_path / "out", TOKENS), logits(src, TOKENS)) <= 1e-4


def test_transmla_keeps_keys_that_are_real_multiples_of_one_key_per_frequency(tiny_model, tmp_path):
    """Per frequency j, KV head g's pair is c[g, j] (real, different per head) times head 0's: RoRoPE keeps it all."""
    src = tiny_model(heads=4, kv_heads=2, head_dim=16)
    coeff = torch.tensor([[1.0] * 8, [-2.0, 0.5, 3.0, -1.0, 0.7, -0.3, 2.0, 1.5]])  # [kv head, frequency]

    def multiples(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if "k_proj" not in name:
            return tensor
        head = tensor[:16]
        return torch.cat([head * coeff[g].repeat(2)[:, None] for g in range(2)])

    edit_weights(src, multiples)
    report = run("transmla", src, tmp_path / "out", rank=48, rope_dim=16)
    assert report["freqfold"] == 1
    assert rel_err(logits(tmp_path / "out", TOKENS), logits(src, TOKENS)) <= 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_qwen2_key_and_value_biases_fold_exactly(tiny_model, tmp_path, method):
    src = tiny_model(family="qwen2", heads=4, kv_heads=2, head_dim=16)
    edit_weights(src, lambda name, t: torch.zeros_like(t) if name.endswith("q_proj.bias") else t)  # no stock home
    edit_weights(src, identical_kv_heads)
    report = run(method, src, tmp_path / "out", rank=48, rope_dim=16)
    assert report["dropped_bias"] == []
    assert json.loads((tmp_path / "out" / "config.json").read_text())["attention_bias"] is True
    assert rel_err(logits(tmp_path / "out", TOKENS), logits(src, TOKENS)) <= 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_half_cut_shares_mlaconv_shapes_and_gives_finite_logits(tiny_model, tmp_path, method):
    src = tiny_model(heads=4, kv_heads=2, head_dim=16)
    report = run(method, src, tmp_path / "out", freqfold=None, kv_keep=0.5)
    _, spec, _ = load_source(str(src))
    shapes = plan_shapes(spec, None, 0.5, None)
    assert (report["kv_lora_rank"], report["qk_rope_head_dim"]) == (shapes.rank, shapes.rope_dim)
    assert report["kv_keep"] == pytest.approx(0.5)
    assert torch.isfinite(logits(tmp_path / "out", TOKENS)).all()
    if method == "transmla":  # TransMLA's auto freqfold tried at least collapse and 2·collapse
        assert len(report["partial_rope_calib_ppl"]) >= 2 and report["freqfold"] in report["partial_rope_calib_ppl"]


@pytest.mark.parametrize("rope_dim, freqfold", [(16, 1), (16, 4), (8, 2), (4, 8)])
def test_rorope_basis_is_orthogonal_with_rope_slots_first(rope_dim, freqfold):
    shape = AttentionShape(hidden=32, heads=4, kv_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(0)
    k = augmented(torch.randn(32, 32, generator=gen, dtype=torch.float64), None)
    x = torch.randn(200, 33, generator=gen, dtype=torch.float64)
    basis = rorope_basis(k, x.T @ x, shape, rope_dim, freqfold)
    assert torch.allclose(basis.T @ basis, torch.eye(32, dtype=torch.float64), atol=1e-12)
    # A slot's (re, im) columns are the same mix of real rows and of imaginary rows (rows j and j + 8).
    re_rows = (torch.arange(2)[:, None] * 16 + torch.arange(8)).flatten()
    assert torch.equal(basis[re_rows, 0], basis[re_rows + 8, 1])
    assert basis[re_rows + 8, 0].abs().max() == 0


def test_transmla_on_qwen3_drops_the_norms_unless_given_the_stand_ins(tiny_model, tmp_path):
    """TransMLA has no place for QK-norm: by default it drops the norms (as its converter does); with mlaconv's
    linear stand-ins it factors those instead. At full rank (MQA) that is the only loss, and the stand-ins lose
    far less (KL per token from the source, computed here from transformers' logits)."""
    src = tiny_model(family="qwen3", heads=4, kv_heads=1, head_dim=16)
    calib = torch.randint(0, 96, (32, 32), generator=torch.Generator().manual_seed(2))
    reference = logits(src, TOKENS).log_softmax(-1)
    kl = {}
    for mode in ("dropped", "stand-in"):
        report = convert_transmla(src, tmp_path / mode, calib, freqfold=1, rank=16, rope_dim=16, qk_norm=mode)
        assert report["kv_lora_rank"] == 16
        converted = logits(tmp_path / mode, TOKENS).log_softmax(-1)
        kl[mode] = (reference.exp() * (reference - converted)).sum(-1).mean().item()
    assert kl["stand-in"] < kl["dropped"] / 4
