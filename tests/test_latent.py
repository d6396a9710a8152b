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
