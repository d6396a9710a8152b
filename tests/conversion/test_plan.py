"""plan.py: the (r, R) choice, the budget, the dtype and precision, the output's size and config, checked against
values worked out by hand (H hidden, N heads, n_kv KV heads, d head dim, L layers)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.plan import (ShapeChoice, estimate_output_bytes, factor_precision, kv_budget, kv_cache_figures,
                                     model_full_rank, output_config, output_dtype, plan_conversion, plan_shapes,
                                     residual_scale, shape_candidates)
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError
from mlaconv.source.spec import SourceSpec, load_source
from mlaconv.target.targets import TARGETS

# H = 64, N = 4, n_kv = 2, d = 16, L = 2: the source caches 2·n_kv·d = 64 values per token and layer
SMALL = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
# Llama-3.2-1B's attention: H = 2048, n_kv = 8, d = 64, so 1024 values per token and layer
ONE_B = {**SMALL, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}


def spec(**changes) -> SourceSpec:
    return SourceSpec.from_config({**SMALL, **changes})


def test_kv_keep_splits_the_budget_into_rope_dims_and_a_latent():
    # 0.5 · 64 = 32 values: R = min(64, d = 16, half of 32 rounded to pairs = 16) = 16, r = 32 − 16 = 16
    half = plan_shapes(spec(), None, 0.5, None)
    assert (half.rank, half.rope_dim, half.cache_elements) == (16, 16, 32)
    assert half.reason.startswith("budget 32 of 64 elements: 16 rope dims (default")
    # 0.25 · 64 = 16: R = 2·(16 // 4) = 8, r = 8
    quarter = plan_shapes(spec(), None, 0.25, None)
    assert (quarter.rank, quarter.rope_dim) == (8, 8)
    given = plan_shapes(spec(), None, 0.5, 8)  # a given R: r fills the rest of the budget
    assert (given.rank, given.rope_dim) == (24, 8) and "8 rope dims (given)" in given.reason


def test_the_latent_is_capped_at_the_full_rank():
    # H = 8 < the 2·16 − 16 = 16 rows of [K_nope; V]: r stops at 8 of the 16 the budget leaves
    narrow = plan_shapes(spec(hidden_size=8, num_attention_heads=1, num_key_value_heads=1), None, 1.0, None)
    assert (narrow.rank, narrow.rope_dim) == (8, 16) and "capped at the full rank 8" in narrow.reason


def test_a_given_rank_keeps_the_default_rope_dims():
    given = plan_shapes(spec(), 20, None, None)
    assert (given.rank, given.rope_dim, given.reason) == (20, 16, "rank given")  # R = min(64, d)


@pytest.mark.parametrize("rank, kv_keep, rope_dim, message", [
    (None, None, None, "exactly one of --rank and --kv-keep"),
    (8, 0.5, None, "exactly one of --rank and --kv-keep"),
    (None, 0.0, None, r"--kv-keep must be in \(0, 1\]"),
    (None, 1.5, None, r"--kv-keep must be in \(0, 1\]"),
    (None, 0.5, 7, "even number"),
    (None, 0.5, 18, "larger than the source head_dim 16"),
    (0, None, None, "--rank must be ≥ 1"),
    (49, None, None, "at most 48"),  # min(H = 64, 2·2·16 − 16)
    (None, 0.03, None, "leaves 1 cache elements"),  # floor(0.03 · 64) = 1: no room for R = 2 and a latent
])
def test_impossible_shapes_are_refused(rank, kv_keep, rope_dim, message):
    with pytest.raises(MlaconvError, match=message):
        plan_shapes(spec(), rank, kv_keep, rope_dim)


def test_budget_and_full_rank_by_hand():
    assert kv_budget(spec(), 0.3, None, None) == (19, 19)  # floor(0.3 · 64 = 19.2)
    hundred = spec(num_attention_heads=5, num_key_value_heads=5, head_dim=10)  # 2·5·10 = 100 values
    assert kv_budget(hundred, 0.29, None, None) == (29, 29)  # 0.29 · 100 is 28.999… in floating point
    assert model_full_rank(spec(), 16) == 48  # min(64, 64 − 16)
    assert model_full_rank(spec(hidden_size=32, num_attention_heads=2), 16) == 32  # min(32, 48)


def test_split_candidates_of_a_llama_1b_budget_by_hand():
    """Half of 1024 is 512: R ∈ {16, 32, 48, 64} (≤ d and half the budget); r = 512 − R rounded down to 16s, but
    the default split (R = 64, r = 448) as ``plan_shapes`` makes it."""
    one_b = SourceSpec.from_config(ONE_B)
    assert [(c.rank, c.rope_dim) for c in shape_candidates(one_b, 0.5)] == [(496, 16), (480, 32), (464, 48), (448, 64)]


def test_output_dtype_and_factor_precision():
    assert output_dtype(spec(), None) == torch.bfloat16  # the source's
    assert output_dtype(spec(), "float32") == torch.float32
    with pytest.raises(MlaconvError, match="float16 output is refused"):
        output_dtype(spec(), "float16")
    with pytest.raises(MlaconvError, match="float16 output is refused"):
        output_dtype(spec(torch_dtype="float16"), None)
    with pytest.raises(MlaconvError, match="--dtype must be one of"):
        output_dtype(spec(), "int8")
    assert [factor_precision(t) for t in (torch.bfloat16, torch.float16, torch.float32, None)] == [
        torch.float32, torch.float32, torch.float64, torch.float64]


def test_residual_scale_brings_the_source_eps_to_deepseeks():
    assert residual_scale(spec()) == pytest.approx(math.sqrt(0.1))  # √(1e-6 / 1e-5)
    assert residual_scale(spec(rms_norm_eps=1e-6)) == 1.0


def test_kv_cache_figures_by_hand():
    # 64 → 24 + 8 = 32 values per layer; over L = 2 layers of bfloat16 (2 bytes): 256 → 128 bytes per token
    assert kv_cache_figures(spec(), ShapeChoice(24, 8, ""), torch.bfloat16) == {
        "elements_per_token_per_layer": {"source": 64, "converted": 32},
        "bytes_per_token": {"source": 256, "converted": 128}}


def test_output_config_moves_the_kept_frequencies_onto_the_rope_slots():
    # R = 8 of d = 16 at stride 1: the slots keep source pairs 0..3, whose base is θ^(8/16) = 100
    config, rewrite = output_config(spec(), ShapeChoice(24, 8, ""), 1, TARGETS["transformers"], False, torch.bfloat16)
    assert config["rope_theta"] == pytest.approx(100.0) and rewrite is None
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["torch_dtype"]) == (24, 8, "bfloat16")
    assert output_config(spec(), ShapeChoice(24, 8, ""), 2, TARGETS["transformers"], False, torch.bfloat16)[0][
        "rope_theta"] == pytest.approx(10000.0)  # pairs 0, 2, 4, 6: θ^(2·8/16)


def test_the_output_size_estimate_is_what_convert_writes(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=16)
    out = tmp_path / "out"
    report = convert(str(src), out, ConvertOptions(rank=24, rope_dim=8, verify=False, absorbed=True))
    written = 0
    for shard in [*out.glob("*.safetensors"), *(out / "absorbed").glob("*.safetensors")]:
        with safe_open(shard, "pt") as tensors:
            written += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    _, tiny, reader = load_source(str(src))
    reader.close()
    shapes = ShapeChoice(report.kv_lora_rank, report.qk_rope_head_dim, "")
    # every tensor but the absorbed folder's rope.inv_freq (R/2 values), at 4 bytes each
    assert estimate_output_bytes(tiny, shapes, torch.float32, absorbed=True) == (written - 8 // 2) * 4


@pytest.mark.parametrize("options, message", [
    ({"rank": 24, "rope_dim": 8, "rope_stride": 3}, "--rope-stride 3 does not fit 8 rope dims"),
    ({"rank": 24, "calib_tokens": 0}, "--calib-tokens must be positive"),
    ({"rank": 24, "refine_steps": -1}, "--refine-steps must be ≥ 0"),
    ({"rank": 24, "refine_minutes": 0}, "--refine-minutes must be a positive number"),
    ({"rank": 24, "refine_minutes": float("nan")}, "--refine-minutes must be a positive number"),
    ({"rank": 24, "calib_sequential": "inputs"}, "--calib-sequential must be one of outputs, residual"),
    ({"rank": 24, "weights_only": True, "calib_sequential": "residual"}, "--calib-sequential chooses and refines"),
    ({"rank": 24, "weights_only": True, "heal_tokens": 1024}, "--heal-tokens trains on calibration data"),
    ({"rank": 24, "refine_batch": 0}, "must be ≥ 1"),
    ({"rank": 24, "target": "nowhere"}, "nowhere"),
    ({"rank": 24, "eval_text": "/no/such/file.txt"}, "evaluation file not found"),
])
def test_plan_conversion_refuses_bad_options_before_any_work(tiny_model, options, message):
    with pytest.raises(MlaconvError, match=message):
        plan_conversion(str(tiny_model(kv_heads=2, head_dim=16)), ConvertOptions(**options))


def test_plan_conversion_opens_the_source_and_fixes_the_layer_options(tiny_model):
    plan = plan_conversion(str(tiny_model(kv_heads=2, head_dim=16)), ConvertOptions(kv_keep=0.5))
    assert (plan.shapes.rank, plan.shapes.rope_dim) == (16, 16)
    assert (plan.shape.hidden, plan.shape.heads, plan.shape.kv_heads, plan.shape.head_dim) == (64, 4, 2, 16)
    assert (plan.layer.rank, plan.layer.rope_dim, plan.layer.context, plan.layer.residual_scale) == (16, 16, 256, 1.0)
    plan.reader.close()
