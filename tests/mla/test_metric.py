"""mla/metric.py for a dense [H, H] metric and a diagonal [H] one, against plain PyTorch and sampled expectations."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import generator
from mlaconv.mla import metric

F64 = torch.float64
H = 6


def samples(n: int = 40, seed: int = 0) -> torch.Tensor:
    """Inputs x [n, H] with unequal scales, so Σ = E[x xᵀ] is dense and far from a multiple of I."""
    return torch.randn(n, H, dtype=F64, generator=generator(seed)) * torch.linspace(0.3, 3.0, H, dtype=F64)


def full_and_diagonal() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, the metric as the module takes it, its dense [H, H] form) for both forms."""
    x = samples()
    dense = x.T @ x / x.shape[0]
    diagonal = torch.rand(H, dtype=F64, generator=generator(1)) * 2 + 0.1
    return [("full", dense, dense), ("diagonal", diagonal, torch.diag(diagonal))]


FORMS = full_and_diagonal()
IDS = [name for name, _, _ in FORMS]


@pytest.mark.parametrize("name, m, dense", FORMS, ids=IDS)
def test_times_is_the_matrix_product(name, m, dense):
    a = torch.randn(2, 3, H, dtype=F64, generator=generator(2))
    torch.testing.assert_close(metric.times(a, m), a @ dense)
    z = torch.randn(4, H, dtype=torch.complex128, generator=generator(3))
    out = metric.times(z, m)
    assert out.is_complex()
    torch.testing.assert_close(out, z @ dense.to(torch.complex128))


def test_times_keeps_the_rows_dtype_for_a_dense_metric():
    a = torch.randn(3, H, dtype=torch.float32, generator=generator(4))
    dense = FORMS[0][1]
    out = metric.times(a, dense)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (a.double() @ dense).float())


@pytest.mark.parametrize("name, m, dense", FORMS, ids=IDS)
def test_energy_is_the_diagonal_of_a_sigma_a_transposed(name, m, dense):
    a = torch.randn(5, H, dtype=F64, generator=generator(5))
    torch.testing.assert_close(metric.energy(a, m), torch.diagonal(a @ dense @ a.T))
    assert metric.total_energy(a, m) == pytest.approx(torch.trace(a @ dense @ a.T).item(), rel=1e-12)
    assert isinstance(metric.total_energy(a, m), float)


def test_energy_is_the_expected_square_of_the_output():
    """E|a·x|² over the very inputs Σ comes from, for real and complex rows."""
    x = samples(seed=6)
    sigma = x.T @ x / x.shape[0]
    a = torch.randn(3, H, dtype=F64, generator=generator(7))
    torch.testing.assert_close(metric.energy(a, sigma), (x @ a.T).pow(2).mean(0))
    z = torch.randn(2, 4, H, dtype=torch.complex128, generator=generator(8))
    outputs = torch.einsum("bkh,sh->bks", z, x.to(torch.complex128))
    expected = outputs.abs().pow(2).mean(-1)
    out = metric.energy(z, sigma)
    assert out.dtype == F64 and out.shape == (2, 4)
    torch.testing.assert_close(out, expected)
    assert metric.total_energy(z, sigma) == pytest.approx(expected.sum().item(), rel=1e-12)


@pytest.mark.parametrize("name, m, dense", FORMS, ids=IDS)
def test_complex_energy_is_the_hermitian_form(name, m, dense):
    z = torch.randn(3, H, dtype=torch.complex128, generator=generator(9))
    hermitian = torch.diagonal(z @ dense.to(torch.complex128) @ z.conj().T)
    torch.testing.assert_close(metric.energy(z, m), hermitian.real)
    assert hermitian.imag.abs().max() < 1e-10


def test_root_of_a_diagonal_is_the_square_root_with_negatives_at_zero():
    m = torch.tensor([4.0, 0.25, 0.0, -1.0], dtype=F64)
    assert metric.root(m).tolist() == [2.0, 0.5, 0.0, 0.0]


def test_root_of_a_positive_definite_metric_is_its_cholesky_factor():
    sigma = FORMS[0][1]
    L = metric.root(sigma)
    assert L.shape == (H, H)
    torch.testing.assert_close(L @ L.T, sigma)
    torch.testing.assert_close(L, torch.tril(L))  # lower triangular
    assert (torch.diagonal(L) > 0).all()


def test_root_of_a_singular_metric_falls_back_to_the_symmetric_root():
    """[[1, 1], [1, 1]] has no Cholesky factor (zero pivot); its PSD root is [[1, 1], [1, 1]] / √2."""
    sigma = torch.ones(2, 2, dtype=F64)
    L = metric.root(sigma)
    torch.testing.assert_close(L, torch.full((2, 2), 1 / math.sqrt(2), dtype=F64))
    torch.testing.assert_close(L @ L.T, sigma)


def test_symmetric_root_squares_back_and_is_symmetric():
    x = samples(n=30, seed=10)
    m = x.T @ x / 30
    s = metric.symmetric_root(m)
    torch.testing.assert_close(s, s.T)
    torch.testing.assert_close(s @ s, m)
    assert torch.linalg.eigvalsh(s).min() > 0


def test_symmetric_root_by_hand():
    # diag(9, 4) in a rotated basis: its root is diag(3, 2) in the same basis
    c, s = math.cos(0.3), math.sin(0.3)
    rotation = torch.tensor([[c, -s], [s, c]], dtype=F64)
    m = rotation @ torch.diag(torch.tensor([9.0, 4.0], dtype=F64)) @ rotation.T
    expected = rotation @ torch.diag(torch.tensor([3.0, 2.0], dtype=F64)) @ rotation.T
    torch.testing.assert_close(metric.symmetric_root(m), expected)


def test_symmetric_root_zeroes_negative_eigenvalues_and_batches():
    q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=F64, generator=generator(11)))
    values = torch.tensor([[4.0, 1.0, -2.0], [9.0, 0.0, 0.25]], dtype=F64)
    m = q @ torch.diag_embed(values) @ q.T  # [2, 3, 3]
    s = metric.symmetric_root(m)
    assert s.shape == (2, 3, 3)
    torch.testing.assert_close(s @ s, q @ torch.diag_embed(values.clamp_min(0)) @ q.T)
    torch.testing.assert_close(torch.linalg.eigvalsh(s), torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.5, 3.0]], dtype=F64))


def test_symmetric_root_uses_the_symmetric_part():
    m = torch.tensor([[2.0, 1.5], [0.5, 2.0]], dtype=F64)  # symmetric part [[2, 1], [1, 2]]
    sym = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=F64)
    s = metric.symmetric_root(m)
    torch.testing.assert_close(s @ s, sym)
