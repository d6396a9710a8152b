"""mla/rope.py's frequencies: the source's (with linear, llama3 and LongRoPE scaling) against transformers' own RoPE
init, and the target base and rope_scaling that make transformers' DeepSeek-V3 serve the kept ones."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from mlaconv.mla import rope

F64 = torch.float64
LINEAR = {"rope_type": "linear", "factor": 4.0}
# original length 64 puts the source's 16 frequencies (θ = 10⁴, d = 32) in all three llama3 bands
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
SHORT = [1.0 + 0.25 * j for j in range(16)]
LONG = [3.0 + 0.5 * j for j in range(16)]
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 64,
            "factor": 4.0, "attention_factor": 1.25}


def transformers_frequencies(config, length: int | None = None) -> torch.Tensor:
    """ω from transformers' own init function for the config's rope type (LongRoPE: at ``length``), as float64."""
    kind = config.rope_parameters["rope_type"]
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=length)[0].to(F64)


def llama_config(theta: float, head_dim: int, scaling: dict | None, max_positions: int = 256) -> LlamaConfig:
    return LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                       max_position_embeddings=max_positions, rope_parameters={"rope_theta": theta, **(scaling or {})})


# --- frequencies: source, target base, rope_scaling -----------------------------------------------------------------

@pytest.mark.parametrize("theta, head_dim, rope_dim, stride, expected", [
    (10000.0, 64, 16, 2, 100.0),  # 10⁴^(2·16/64)
    (10000.0, 128, 64, 1, 100.0),  # 10⁴^(64/128)
    (500000.0, 64, 32, 2, 500000.0),  # s·R = d: the base is kept
    (1e6, 128, 32, 3, 1e6 ** 0.75),
])
def test_target_rope_theta_by_hand(theta, head_dim, rope_dim, stride, expected):
    assert rope.target_rope_theta(theta, head_dim, rope_dim, stride) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("stride", [1, 2, 3, 4])
def test_target_base_puts_the_source_frequencies_0_s_2s_on_the_slots(stride):
    theta, d, R = 10000.0, 64, 16
    source = [theta ** (-2 * j / d) for j in range(d // 2)]
    target_theta = rope.target_rope_theta(theta, d, R, stride)
    target = [target_theta ** (-2 * i / R) for i in range(R // 2)]
    assert target == pytest.approx([source[stride * i] for i in range(R // 2)], rel=1e-12)
    # and as transformers' DeepSeek-V3 computes its slots' ω from that base
    config = DeepseekV3Config(qk_rope_head_dim=R, rope_parameters={"rope_type": "default", "rope_theta": target_theta})
    served = DeepseekV3RotaryEmbedding(config).inv_freq.to(F64)
    torch.testing.assert_close(served, torch.tensor(source, dtype=F64)[rope.kept_frequencies(R, stride)], rtol=1e-5,
                               atol=0)


def test_source_frequencies_by_hand():
    omega = rope.source_frequencies(10000.0, 8)
    assert omega.dtype == F64
    assert omega.tolist() == pytest.approx([1.0, 0.1, 0.01, 0.001], rel=1e-12)
    assert torch.equal(rope.scaled_frequencies(10000.0, 8, None), omega)
    assert torch.equal(rope.scaled_frequencies(10000.0, 8, {"rope_type": "default"}), omega)


@pytest.mark.parametrize("scaling", [LINEAR, LLAMA3], ids=["linear", "llama3"])
def test_scaled_frequencies_match_transformers(scaling):
    theta, d = 10000.0, 32
    reference = transformers_frequencies(llama_config(theta, d, scaling))
    torch.testing.assert_close(rope.scaled_frequencies(theta, d, scaling), reference, rtol=1e-5, atol=0)
    assert not torch.allclose(reference, rope.source_frequencies(theta, d))  # the scaling does something


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "made-up"])
def test_scaled_frequencies_refuses_a_rope_type_it_cannot_scale(kind):
    with pytest.raises(ValueError, match=f"rope type '{kind}'"):
        rope.scaled_frequencies(10000.0, 8, {"rope_type": kind, "factor": 2.0})


def test_llama3_case_covers_all_three_bands():
    omega = rope.source_frequencies(10000.0, 32)
    wavelength = 2 * math.pi / omega
    assert (wavelength < 64 / 4).any() and (wavelength > 64).any() and ((wavelength > 16) & (wavelength < 64)).any()


@pytest.mark.parametrize("length", [None, 64, 65, 200])
def test_scaled_frequencies_match_transformers_longrope(length):
    """Partial rotary as Phi-3 has it: ω over the d_rot = 32 rotated dims of a 64-dim head."""
    theta = 10000.0
    # Phi3Config overwrites rope_parameters' original length with its own top-level one
    config = Phi3Config(hidden_size=128, num_attention_heads=2, max_position_embeddings=256, partial_rotary_factor=0.5,
                        original_max_position_embeddings=64, rope_parameters={"rope_theta": theta, "partial_rotary_factor": 0.5, **LONGROPE})
    reference = transformers_frequencies(config, length)
    assert reference.shape == (16,)
    ours = rope.scaled_frequencies(theta, 32, LONGROPE, length)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=0)
    factors = torch.tensor(LONG if length is not None and length > 64 else SHORT, dtype=F64)
    torch.testing.assert_close(ours * factors, rope.source_frequencies(theta, 32))


def test_pair_frequencies_appends_zeros_for_the_pairs_that_pass():
    out = rope.pair_frequencies(torch.tensor([1.0, 0.5, 0.25], dtype=torch.float32), head_dim=10)
    assert out.dtype == F64 and out.tolist() == [1.0, 0.5, 0.25, 0.0, 0.0]
    assert rope.pair_frequencies(torch.ones(4), 8).tolist() == [1.0] * 4


def test_target_rope_scaling_carries_linear_and_llama3_over_as_copies():
    assert rope.target_rope_scaling(None, torch.arange(4)) is None
    for scaling in (LINEAR, LLAMA3):
        out = rope.target_rope_scaling(scaling, torch.tensor([0, 3, 6]))
        assert out == scaling and out is not scaling


def test_target_rope_scaling_picks_longrope_factors_at_the_kept_pairs():
    out = rope.target_rope_scaling(LONGROPE, torch.tensor([0, 3, 6, 9]))
    assert out["short_factor"] == [SHORT[0], SHORT[3], SHORT[6], SHORT[9]]
    assert out["long_factor"] == [LONG[0], LONG[3], LONG[6], LONG[9]]
    assert out["attention_factor"] == 1.0
    assert {k: out[k] for k in ("rope_type", "original_max_position_embeddings", "factor")} == \
        {"rope_type": "longrope", "original_max_position_embeddings": 64, "factor": 4.0}
    assert LONGROPE["attention_factor"] == 1.25 and len(LONGROPE["short_factor"]) == 16  # the input is untouched


@pytest.mark.parametrize("scaling, length", [(None, None), (LINEAR, None), (LLAMA3, None), (LONGROPE, 10),
                                             (LONGROPE, 100)], ids=["default", "linear", "llama3", "short", "long"])
@pytest.mark.parametrize("stride", [1, 2, 5])
def test_transformers_deepseek_target_serves_the_kept_source_frequencies(scaling, length, stride):
    """Source ω (transformers' Llama) at pairs 0, s, 2s… = the ω transformers' DeepSeek-V3 computes from
    target_rope_theta and target_rope_scaling."""
    theta, d, R = 10000.0, 32, 8
    source = llama_config(theta, d, scaling)
    kept = rope.kept_frequencies(R, stride)
    target_scaling = rope.target_rope_scaling(scaling, kept) or {"rope_type": "default"}
    target = DeepseekV3Config(qk_rope_head_dim=R, max_position_embeddings=256, rope_parameters={
        "rope_theta": rope.target_rope_theta(theta, d, R, stride), **target_scaling})
    if scaling is None:
        served = DeepseekV3RotaryEmbedding(target).inv_freq.to(F64)
        reference = rope.source_frequencies(theta, d)
    else:
        served = transformers_frequencies(target, length)
        reference = transformers_frequencies(source, length)
        # the source side picked the factors of that length (LongRoPE: short up to 64 tokens, long beyond)
        torch.testing.assert_close(reference, rope.scaled_frequencies(theta, d, scaling, length), rtol=1e-5, atol=0)
    torch.testing.assert_close(served, reference[kept], rtol=1e-5, atol=0)
