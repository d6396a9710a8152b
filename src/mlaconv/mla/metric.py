"""The input metric Σ = E[x xᵀ] of a layer's attention inputs x [H].

With calibration Σ is a dense [H, H] matrix. Without data it is diag γ² and is kept as its diagonal [H]:
every product with it is then a scaling, O(m·H) instead of O(m·H²) — at H = 8192 that is the difference
between seconds and minutes per layer. Every use of Σ goes through these helpers, so both forms work.
"""

from __future__ import annotations

import torch


def times(a: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """a·Σ for rows a [..., H] (real or complex; Σ is real, so a complex a takes two real products)."""
    if metric.dim() == 1:
        return a * metric
    metric = metric.to(a.real.dtype)
    if a.is_complex():
        return torch.complex(a.real @ metric, a.imag @ metric)
    return a @ metric


def energy(a: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """E|a·x|² per row of a [..., H] → [...]: Re((a·Σ)·conj(a)), for a complex a = aᵣΣaᵣ + aᵢΣaᵢ."""
    if a.is_complex():
        return energy(a.real, metric) + energy(a.imag, metric)
    return (times(a, metric) * a).sum(-1)


def total_energy(a: torch.Tensor, metric: torch.Tensor) -> float:
    """Σ E|a_i·x|² over all rows of a [..., H]."""
    return energy(a, metric).sum().item()


def root(metric: torch.Tensor) -> torch.Tensor:
    """L with L Lᵀ = Σ, in the same form as Σ: √diag for a diagonal, Cholesky when Σ is positive definite,
    else the symmetric square root."""
    if metric.dim() == 1:
        return metric.clamp_min(0).sqrt()
    factor, info = torch.linalg.cholesky_ex(metric)
    return factor if info.item() == 0 else symmetric_root(metric)


def symmetric_root(m: torch.Tensor) -> torch.Tensor:
    """The symmetric PSD square root of (batches of) symmetric matrices m [..., n, n]; negative eigenvalues → 0."""
    values, vectors = torch.linalg.eigh(0.5 * (m + m.transpose(-1, -2)))
    return (vectors * values.clamp_min(0).sqrt()[..., None, :]) @ vectors.transpose(-1, -2)
