"""Serving targets (``--target``): the output holds only what its engines honour, and the report says what they compute.

The frequencies vLLM would use are derived in this file from vLLM 0.33.0's DeepSeek-YaRN
(``model_executor/layers/rotary_embedding/deepseek_scaling_rope.py``, ``common.py``: correction range
⌊c(β_fast)⌋..⌈c(β_slow)⌉, c(n) = R·ln(L/(2πn))/(2 ln θ), ramp linear in the slot index) and its rewrite in
``model_executor/models/deepseek_v2.py`` (any non-default rope_type; ``deepseek_llama_scaling`` without the
softmax mscale when attention_factor is 1.0).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from helpers import random_tokens, spec_for, write_tokens
from mlaconv.cli import app
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.io.models import load_causal_lm
from mlaconv.mla import rope

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def tensor_names(folder) -> list[str]:
    names = []
    for shard in folder.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            names += list(f.keys())
    return names


def vllm_frequencies(config: dict) -> torch.Tensor:
    """What vLLM computes from this config.json's rope settings, derived here from its formulas."""
    R, theta, scaling = config["qk_rope_head_dim"], config["rope_theta"], config["rope_scaling"]
    base = [theta ** (-2 * i / R) for i in range(R // 2)]
    if not scaling:
        return torch.tensor(base, dtype=torch.float64)
    f, L = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
    dim = lambda n: R * math.log(L / (n * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = max(math.floor(dim(fast)), 0), min(math.ceil(dim(slow)), R - 1)
    out = []
    for i, b in enumerate(base):
        ramp = min(max((i - low) / ((high + 0.001 if low == high else high) - low), 0), 1)
        out.append(b / f * ramp + b * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


def test_portable_is_the_default_and_writes_no_biases(tiny_model, tmp_path):
    src = tiny_model(family="qwen2", kv_heads=2, head_dim=16)
    report = convert(str(src), tmp_path / "out", ConvertOptions(rank=48, rope_dim=16))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert report.target.name == "portable" and config["attention_bias"] is False
    assert not [n for n in tensor_names(tmp_path / "out") if n.endswith(".bias")]
    assert report.target.biases_left_out == ["kv_a_proj_with_mqa.bias", "o_proj.bias"]
    assert "--calib" in report.target.note and "--target transformers" in report.target.note
    engines = report.verify.engines
    assert all(engines[name]["same_as"] == "transformers" for name in ("vllm", "sglang", "llamacpp"))
    # the cost of leaving the biases out is what transformers (and so every engine) measures
    kept = convert(str(src), tmp_path / "kept", ConvertOptions(rank=48, rope_dim=16, target="transformers"))
    assert kept.verify.engines["vllm"]["kl"] == pytest.approx(report.verify.kl, rel=1e-6)
    assert report.verify.kl > kept.verify.kl


def test_unknown_target_is_refused_in_one_line(tiny_model, tmp_path):
    src = tiny_model(kv_heads=1, head_dim=16)
    with pytest.raises(MlaconvError, match=r"--target 'tensorrt': choose one of portable, transformers"):
        convert(str(src), tmp_path / "out", ConvertOptions(rank=16, target="tensorrt"))
    result = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out"), "--rank", "16", "--target", "x",
                                      "--json", "--quiet"])
    assert result.exit_code != 0 and json.loads(result.stdout)["error"].startswith("--target 'x'")
    assert not (tmp_path / "out").exists()


def test_llama3_source_frequencies_vllm_uses_equal_the_converted_models(tiny_model, tmp_path):
    """portable: the yarn rope_scaling written is computed alike by vLLM (derived here) and transformers (the
    loaded model's inv_freq); its gap to the source's llama3 frequencies is reported, bounded and smaller
    than vLLM's rewrite of the llama3 config as transformers would need it."""
    src = tiny_model(kv_heads=1, head_dim=32, rope_scaling=dict(LLAMA3), rope_theta=10000.0)
    report = convert(str(src), tmp_path / "out", ConvertOptions(rank=16, rope_dim=32))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_scaling"]["attention_factor"] == 1.0
    served = vllm_frequencies(config)
    model = load_causal_lm(tmp_path / "out")
    assert torch.allclose(model.model.rotary_emb.inv_freq.double(), served, rtol=1e-6, atol=0)
    assert model.model.rotary_emb.attention_scaling == 1.0
    assert model.model.layers[0].self_attn.scaling == pytest.approx(64 ** -0.5)  # (d + R)^-½: no mscale
    source = rope.scaled_frequencies(10000.0, 32, LLAMA3)  # the source's llama3 ω, all 16 kept (R = d)
    gap = (served / source - 1).abs()
    rewrite = report.target.rope_rewrite
    assert rewrite["max_relative_frequency_gap"] == pytest.approx(gap.max().item(), rel=1e-6)
    assert rewrite["slots_differing"] == int((gap > 1e-9).sum()) < 16
    wavelength = 2 * math.pi / rope.source_frequencies(10000.0, 32)
    outside = (wavelength < 64 / 4) | (wavelength > 64 / 1)  # outside llama3's smoothing band: exact
    assert gap[outside].max() < 1e-12
    as_is = vllm_frequencies({**config, "rope_scaling": LLAMA3})  # vLLM on the llama3 config itself
    assert gap.max() < (as_is / source - 1).abs().max()
    engines = report.verify.engines
    assert engines["vllm"]["same_as"] == "transformers" and engines["sglang"]["same_as"] == "transformers"
    assert "rope_type 'yarn'" in engines["llamacpp"]["refused"]


def test_llama3_for_transformers_keeps_llama3_and_vllm_figures_differ(tiny_model, tmp_path):
    src = tiny_model(kv_heads=1, head_dim=16, rope_scaling=dict(LLAMA3))
    report = convert(str(src), tmp_path / "out", ConvertOptions(rank=16, rope_dim=16, target="transformers"))
    assert report.target.rope_rewrite is None
    vllm = report.verify.engines["vllm"]
    assert any(d.startswith("rope frequencies differ") for d in vllm["differences"])
    assert any(d.startswith("cos/sin scale") for d in vllm["differences"])
    assert vllm["kl"] > report.verify.kl


def test_calibrated_portable_refits_without_biases(tiny_model, tmp_path):
    """With calibration data the bias-free layers are re-fitted (biases fixed at zero): the refinement lowers the
    attention error of the layers it keeps, no bias tensor is written, and the note says so."""
    src = tiny_model(family="qwen2", kv_heads=2, head_dim=16)
    calib = write_tokens(tmp_path / "calib.jsonl", random_tokens(24, 32, seed=3))
    options = ConvertOptions(rank=24, rope_dim=16, calib=[str(calib)], calib_tokens=24 * 32, calib_window=32,
                             refine_steps=30, refine_batch=4, refine_check_every=5)
    report = convert(str(src), tmp_path / "out", options)
    assert not [n for n in tensor_names(tmp_path / "out") if n.endswith(".bias")]
    assert "re-fitted" in report.target.note and "folded" in report.target.note
    refinements = [s.refinement for s in report.calibration.selection]
    assert any(r.kept and r.after < r.before for r in refinements)
    assert report.verify.engines["vllm"]["same_as"] == "transformers"


def test_bias_fold_is_exact_when_the_input_has_a_constant_direction():
    """Left-out biases are read off the input along w = E[xxᵀ]⁻¹E[x]: with a constant input coordinate (wᵀx = 1 for
    every token) the bias-free layer's values and rope key equal the biased layer's (values + b_v, κ + its bias)."""
    from dataclasses import replace

    from mlaconv.mla.attention import factor_attention, full_rank

    from mlaconv.mla.layer import AttentionShape, LayerOptions, SourceAttention

    from mlaconv.mla.shared_key import weights_only_stats

    g = torch.Generator().manual_seed(0)
    shape = AttentionShape(hidden=32, heads=4, kv_heads=2, head_dim=8)
    H, N, G, d = 32, 4, 2, 8
    src = SourceAttention(q=torch.randn(N * d, H, generator=g), k=torch.randn(G * d, H, generator=g),
                          v=torch.randn(G * d, H, generator=g), o=torch.randn(H, N * d, generator=g),
                          input_norm=torch.ones(H), q_bias=None, k_bias=torch.randn(G * d, generator=g),
                          v_bias=torch.randn(G * d, generator=g))
    x = torch.randn(500, H, generator=g, dtype=torch.float64)
    x[:, 0] = 1.0  # a constant coordinate
    options = LayerOptions(rank=full_rank(shape, 8), rope_dim=8, rope_theta=10000.0, rope_stride=1)
    stats = replace(weights_only_stats(src.input_norm, shape, options), metric=x.T @ x / len(x), mean=x.mean(0))
    kept, _ = factor_attention(src, shape, options, stats)
    folded, report = factor_attention(src, shape, replace(options, biases=False), stats)
    assert folded.k_rope_bias is None and folded.o_bias is None
    assert report.dropped_bias == ["kv_a_proj_with_mqa.bias", "o_proj.bias"]
    values = x @ (folded.up_v @ folded.down).T
    assert torch.allclose(values, x @ src.v.double().T + src.v_bias.double(), atol=1e-8)
    assert torch.allclose(x @ folded.k_rope.T, x @ kept.k_rope.T + kept.k_rope_bias, atol=1e-8)


def test_served_shapes_vllm_requires_them_portable_prefers_them(tiny_model, tmp_path):
    """vLLM runs MLA only at r + R ∈ {320, 512, 576}: --target vllm takes the largest of them within the --kv-keep
    budget whose latent fits the model, and refuses in one line a budget or --rank that fits none (suggesting a
    --kv-keep that works); portable takes one where the budget allows and the whole budget otherwise."""
    from helpers import assert_refused, cli

    from mlaconv.source.spec import SourceSpec
    from mlaconv.conversion.plan import plan_shapes, shape_candidates
    from mlaconv.target.targets import target

    vllm, portable = target("vllm"), target("portable")
    one_b = spec_for("llama-3.2-1b")  # 1024 cache elements per token and layer, hidden 2048
    for kv_keep, width in ((0.5, 512), (0.55, 512), (0.6, 576), (0.35, 320), (1.0, 576)):
        for chosen in (vllm, portable):
            shapes = plan_shapes(one_b, None, kv_keep, None, chosen)
            assert (shapes.rank + shapes.rope_dim, shapes.rope_dim) == (width, 64)
            assert {c.rank + c.rope_dim for c in shape_candidates(one_b, kv_keep, chosen)} == {width}
    assert "held to 512 of a budget of 563" in plan_shapes(one_b, None, 0.55, None, portable).reason
    assert plan_shapes(one_b, None, 0.55, None, target("sglang")).rank + 64 == 563  # no vLLM shapes to keep to
    assert plan_shapes(one_b, None, 0.25, None, portable).rank + 64 == 256  # none fits: the whole budget
    assert plan_shapes(one_b, None, 0.6, 32, vllm).rank == 544  # --rope-dim given: r fills 576 around it
    eight_b = spec_for("llama-3.1-8b")  # 2048 elements: 320 is 15.625% of them
    with pytest.raises(MlaconvError, match=r"use --kv-keep ≥ 0\.1563") as refused:
        plan_shapes(eight_b, None, 0.1, None, vllm)
    assert "--target vllm: vllm runs MLA only with r + R in {320, 512, 576}" in str(refused.value)
    assert plan_shapes(eight_b, None, 0.1563, None, vllm).rank == 256  # the suggestion works
    with pytest.raises(MlaconvError, match=r"r \+ R = 400 \+ 64 = 464"):
        plan_shapes(one_b, 400, None, 64, vllm)
    assert plan_shapes(one_b, 400, None, 64, portable).rank == 400  # a given --rank is the user's choice
    with pytest.raises(MlaconvError, match="none of them compresses"):
        plan_shapes(spec_for("qwen2.5-0.5b"), None, 1.0, None, vllm)  # 256 elements

    narrow = tiny_model("narrow", heads=8, kv_heads=8, head_dim=64, hidden=320, layers=1)  # 1024 elements, full rank 320
    narrow_spec = SourceSpec.from_config(json.loads((narrow / "config.json").read_text()))
    assert plan_shapes(narrow_spec, None, 1.0, None, vllm).rank == 256  # 576 and 512 need r > 320: 320 it is

    src = tiny_model(heads=8, kv_heads=4, head_dim=64, hidden=320, layers=1)  # 512 elements, full rank 320
    write_tokens(tmp_path / "calib.jsonl", random_tokens(8, 48, seed=8))
    report = convert(str(src), str(tmp_path / "out"), ConvertOptions(kv_keep=0.7, target="vllm", verify=False,
                                                                   calib=[str(tmp_path / "calib.jsonl")],
                                                                   calib_window=48, refine_steps=0))
    table = report.shape_search.candidates  # the calibrated split search compares only splits of 320
    assert len(table) >= 2 and {row.kv_lora_rank + row.qk_rope_head_dim for row in table} == {320}
    assert report.kv_lora_rank + report.qk_rope_head_dim == 320
    assert "of a budget of 358 elements (held to 320" in report.shape_choice
    small = tiny_model("small")
    assert_refused(cli(small, tmp_path / "refused", "--kv-keep", "0.5", "--target", "vllm"), tmp_path / "refused",
                   match="vllm runs MLA only with r + R in {320, 512, 576}")
