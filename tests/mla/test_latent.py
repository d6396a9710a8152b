"""Property tests of the joint-latent linear algebra (mlaconv.mla.latent)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaconv.mla import latent
from mlaconv.mla.latent_norm import DEFAULT_DELTA, LATENT_NORM_EPS, tiny_latent

sizes = st.tuples(st.integers(2, 24), st.integers(2, 24))


def random_problem(rows: int, inputs: int, seed: int, diagonal: bool, singular: bool):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(rows, inputs, generator=g, dtype=torch.float64)
    if diagonal:
        metric = torch.diag(torch.rand(inputs, generator=g, dtype=torch.float64) + 0.1)
    else:
        x = torch.randn(inputs if not singular else max(1, inputs // 2), inputs, generator=g, dtype=torch.float64)
        metric = x.T @ x / x.shape[0]
    if singular and diagonal:
        metric[0, 0] = 0.0
    return target, metric


@settings(max_examples=60, deadline=None)
@given(size=sizes, seed=st.integers(0, 2**31 - 1), diagonal=st.booleans(), singular=st.booleans(),
       rank_fraction=st.floats(0.0, 1.0))
def test_energy_is_one_minus_the_measured_error(size, seed, diagonal, singular, rank_fraction):
    """Unit weights: energy at rank r = 1 − ‖(T − BA)Σ½‖²/‖TΣ½‖², on both sides of m = H."""
    rows, inputs = size
    target, metric = random_problem(rows, inputs, seed, diagonal, singular)
    rank = max(1, round(rank_fraction * min(rows, inputs)))
    lat = latent.factor(target, torch.ones(rows, dtype=torch.float64), metric, rank)
    error = latent.relative_error(target, lat.up @ lat.down, metric)
    assert abs((1 - lat.energy) - error) <= 1e-9
    assert lat.down.shape == (rank, inputs) and lat.up.shape == (rows, rank)


@settings(max_examples=40, deadline=None)
@given(size=sizes, seed=st.integers(0, 2**31 - 1), diagonal=st.booleans(), singular=st.booleans())
def test_tall_spectrum_equals_the_direct_one(size, seed, diagonal, singular):
    """More rows than inputs: the small-side eigenproblem gives the nonzero spectrum of M Σ Mᵀ."""
    rows, inputs = max(size) + 1, min(size)
    target, metric = random_problem(rows, inputs, seed, diagonal, singular)
    fast = latent.spectrum(target, metric)
    direct = torch.linalg.eigvalsh(target @ metric @ target.T).flip(0).clamp_min(0)
    assert fast.values.shape == (inputs,)
    scale = direct[0].item() + 1e-300
    assert torch.allclose(fast.values, direct[:inputs], atol=1e-10 * scale, rtol=0)
    assert direct[inputs:].abs().max().item() <= 1e-10 * scale
    for r in range(1, inputs + 1):
        assert abs(fast.energy(r) - direct[:r].sum().item() / direct.sum().item()) <= 1e-9


def test_full_rank_reconstructs_exactly_when_tall():
    target, metric = random_problem(20, 6, 0, diagonal=False, singular=False)
    lat = latent.factor(target, torch.ones(20, dtype=torch.float64), metric, 6)
    assert lat.energy == 1.0 or abs(lat.energy - 1.0) <= 1e-12
    assert torch.allclose(lat.up @ lat.down, target, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(size=sizes, seed=st.integers(0, 2**31 - 1), rank_fraction=st.floats(0.0, 1.0))
def test_a_diagonal_metric_given_as_its_diagonal_gives_the_same_latent(size, seed, rank_fraction):
    """Weights-only conversion keeps diag γ² as a vector; every result equals the dense diag(γ²) one."""
    rows, inputs = size
    target, dense = random_problem(rows, inputs, seed, diagonal=True, singular=False)
    diagonal = dense.diagonal().clone()
    rank = max(1, round(rank_fraction * min(rows, inputs)))
    weights = torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    a = latent.factor(target, weights, dense, rank)
    b = latent.factor(target, weights, diagonal, rank)
    assert abs(a.energy - b.energy) <= 1e-12
    assert torch.allclose(a.up @ a.down, b.up @ b.down, atol=1e-9 * target.abs().max().item())
    assert abs(latent.relative_error(target, b.up @ b.down, diagonal)
               - latent.relative_error(target, a.up @ a.down, dense)) <= 1e-12


@settings(max_examples=60, deadline=None)
@given(size=sizes, seed=st.integers(0, 2**31 - 1), diagonal=st.booleans(), singular=st.booleans(),
       rank_fraction=st.floats(0.0, 1.0))
def test_the_up_projection_for_diagonal_row_weights_is_the_least_squares_one(size, seed, diagonal, singular,
                                                                             rank_fraction):
    """``factor``'s B = Lw⁻¹U_r equals argmin_B ‖(T − BA)Σ½‖ (``least_squares_up``) on what Σ sees."""
    rows, inputs = size
    target, metric = random_problem(rows, inputs, seed, diagonal, singular)
    rank = max(1, round(rank_fraction * min(rows, inputs)))
    weights = torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    lat = latent.factor(target, weights, metric, rank)
    fitted = latent.least_squares_up(target, lat.down, metric)
    scale = (target @ metric).abs().max().item() + 1e-300
    assert torch.allclose(lat.up @ lat.down @ metric, fitted @ lat.down @ metric, atol=1e-8 * scale, rtol=0)
    assert abs(latent.relative_error(target, lat.up @ lat.down, metric)
               - latent.relative_error(target, fitted @ lat.down, metric)) <= 1e-9


@pytest.mark.parametrize("scale", [1e-170, 1.0, 1e150])
def test_tiny_latent_bound_at_extreme_scales(scale):
    """σ_max comes from a Gram of the scaled latent: no underflow to an 'all-zero' latent, no overflow."""
    g = torch.Generator().manual_seed(0)
    down = torch.randn(12, 40, generator=g, dtype=torch.float64) * scale
    gamma = torch.rand(40, generator=g, dtype=torch.float64) + 0.5
    tiny = tiny_latent(down, gamma, typical_rms=scale)
    sigma = torch.linalg.matrix_norm(down * gamma, ord=2).item()
    assert tiny.up_scale == scale and math.isfinite(tiny.beta) and tiny.beta > 0
    assert tiny.beta * sigma == pytest.approx(math.sqrt(DEFAULT_DELTA * LATENT_NORM_EPS * 12 / 40), rel=1e-12)
    assert tiny.bound == pytest.approx(DEFAULT_DELTA, rel=1e-12)


@pytest.mark.parametrize("latent_scale", [1e-7, 1e-3, 1.0])
def test_input_scale_balances_the_latent_rows_against_the_input_within_the_cap(latent_scale):
    """s is a power of two ≤ 1; the latent rows ÷ s and the input × s end within √2 of each other in RMS unless
    the cap binds, and no reader ÷ s exceeds MAX_ENTRY."""
    from mlaconv.mla.latent_norm import MAX_ENTRY, input_scale

    g = torch.Generator().manual_seed(1)
    latent_rows = torch.randn(16, 64, generator=g, dtype=torch.float64) * latent_scale
    q = torch.randn(32, 64, generator=g, dtype=torch.float64) * 0.5
    input_rms = 1.3
    s = input_scale(latent_rows, [q, latent_rows], input_rms)
    assert s <= 1 and math.log2(s) == round(math.log2(s))
    assert max(q.abs().max().item(), latent_rows.abs().max().item()) / s <= MAX_ENTRY
    balance = (latent_rows.pow(2).mean().sqrt().item() / s) / (s * input_rms)
    capped = q.abs().max().item() / (s / 2) > MAX_ENTRY
    assert s == 1.0 or capped or 0.5 <= balance <= 2.0
    assert latent_scale != 1e-7 or capped  # the tiny case hits the cap with these readers, the others do not
    assert latent_scale == 1e-7 or not capped


def test_the_input_scale_leaves_the_attention_unchanged():
    """reference.mla_attention of a converted layer on its own input s·x equals the unscaled layer on x."""
    from dataclasses import replace

    from mlaconv.mla.attention import convert_attention

    from mlaconv.mla.layer import AttentionShape, LayerOptions, SourceAttention
    from mlaconv.mla.forward import mla_attention
    from mlaconv.mla.rope import rope_angles

    g = torch.Generator().manual_seed(2)
    H, N, G, d, R, r = 32, 4, 2, 8, 4, 12
    src = SourceAttention(q=torch.randn(N * d, H, generator=g), k=torch.randn(G * d, H, generator=g),
                          v=torch.randn(G * d, H, generator=g), o=torch.randn(H, N * d, generator=g),
                          input_norm=torch.rand(H, generator=g) + 0.5, k_bias=torch.randn(G * d, generator=g))
    options = LayerOptions(rank=r, rope_dim=R, rope_theta=10000.0, rope_stride=1)
    mla, _ = convert_attention(src, AttentionShape(H, N, G, d), options)
    s = (mla.input_norm / src.input_norm.double())[0].item()
    assert s < 1e-2 and torch.allclose(mla.input_norm, src.input_norm.double() * s, rtol=1e-15, atol=0)
    unscaled = replace(mla, q_proj=mla.q_proj * s, kv_a_proj=mla.kv_a_proj * s, input_norm=src.input_norm.double())
    x = torch.randn(2, 10, H, generator=g, dtype=torch.float64) * src.input_norm.double()
    angles = rope_angles(torch.rand(R // 2, generator=g, dtype=torch.float64), 10)  # any: the same for both
    heads = AttentionShape(H, N, G, d)
    scaled_out = mla_attention(x * s, mla, heads, r, R, angles)
    unscaled_out = mla_attention(x, unscaled, heads, r, R, angles)
    assert torch.allclose(scaled_out, unscaled_out, rtol=1e-12, atol=1e-12 * unscaled_out.abs().max().item())
