"""The joint K/V latent: a rank-r down-projection shared by the NoPE keys and the values.

Given the stacked target map T = [K_nope; V] (T: [m, H], m = 2·n_kv·d) and the input metric
Σ = E[x xᵀ] [H, H], we choose the latent basis from a weighted, balanced copy M = Lw·T, where Lw
balances K against V and may weight rows by what the error costs downstream. The rank-r optimum of
‖(M − M̂)Σ½‖ keeps the top-r left singular vectors U_r of M·Σ½, so the down-projection is

    A = U_rᵀ·M                          [r, H]     (the latent c = A·x)

and the up-projections are the least-squares fit of the *unweighted* target on that latent:

    B = T Σ Aᵀ (A Σ Aᵀ)⁺                [m, r]     (T·x ≈ B·c)

For unit weights this is exactly the truncated SVD; with weights it is still the best B for the
chosen A. With U_r the eigenvectors of M Σ Mᵀ, A Σ Aᵀ = Λ_r and T Σ Aᵀ = Lw⁻¹·U_r·Λ_r, so for an
invertible diagonal Lw (the balanced weights) B = Lw⁻¹·U_r: no product with Σ is formed.

``energy`` is Σ_{i<r} λ_i / Σ λ_i over the eigenvalues λ of M Σ Mᵀ: the fraction of the (weighted) output
energy the latent keeps, which equals 1 − ‖(M − U_rU_rᵀM)Σ½‖² / ‖MΣ½‖² exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlaconv.mla import metric as metric_math


@dataclass(frozen=True)
class Spectrum:
    """Eigenvalues (descending) of M Σ Mᵀ and the matching left singular vectors of M Σ½."""

    values: torch.Tensor  # [n], n = min(m, H) when m > H, else m
    vectors: torch.Tensor  # [m, n]

    def energy(self, rank: int) -> float:
        total = self.values.sum().item()
        return self.values[:rank].sum().item() / total if total > 0 else 1.0

    def energy_curve(self) -> torch.Tensor:
        """Energy retained at every rank 1..m."""
        total = self.values.sum()
        if total <= 0:
            return torch.ones_like(self.values)
        return self.values.cumsum(0) / total


def spectrum(weighted: torch.Tensor, metric: torch.Tensor) -> Spectrum:
    """Spectrum of a weighted map M [m, H] in the input metric Σ ([H, H] or its diagonal; float64).

    With more rows than inputs (MHA: m = 2·n_kv·d > H) the eigenproblem is solved on the smaller side:
    M Σ Mᵀ = (M L)(M L)ᵀ with Σ = L Lᵀ has the nonzero eigenvalues of (M L)ᵀ(M L) [H, H], and its
    eigenvectors are M L v / σ. Then ``values`` and ``vectors`` have H entries, not m; the rest are 0.
    """
    rows, inputs = weighted.shape
    if rows <= inputs:
        gram = metric_math.times(weighted, metric) @ weighted.T
        values, vectors = torch.linalg.eigh(0.5 * (gram + gram.T))
        return Spectrum(values=values.flip(0).clamp_min(0), vectors=vectors.flip(1))
    rooted = metric_math.times(weighted, metric_math.root(metric))  # M L [m, H]
    gram = rooted.T @ rooted
    values, right = torch.linalg.eigh(0.5 * (gram + gram.T))
    values, right = values.flip(0).clamp_min(0), right.flip(1)
    sigma = values.sqrt()
    cutoff = sigma.max() * max(rows, inputs) * torch.finfo(sigma.dtype).eps
    scale = torch.where(sigma > cutoff, 1.0 / sigma.clamp_min(torch.finfo(sigma.dtype).tiny), torch.zeros_like(sigma))
    return Spectrum(values=values, vectors=(rooted @ right) * scale)


@dataclass(frozen=True)
class Latent:
    """A factorization T·x ≈ B·(A·x) of the stacked [K_nope; V] map."""

    down: torch.Tensor  # A [r, H]
    up: torch.Tensor  # B [m, r]
    energy: float  # fraction of weighted energy kept at this rank


def factor(target: torch.Tensor, row_weight: torch.Tensor, metric: torch.Tensor, rank: int,
           spec: Spectrum | None = None) -> Latent:
    """Rank-``rank`` latent for ``target`` [m, H] whose basis is chosen in the ``row_weight``·target metric.

    row_weight [m, m] (or [m] for a diagonal) must be invertible on the rows that carry energy.
    """
    weighted = weigh(row_weight, target)
    spec = spec if spec is not None else spectrum(weighted, metric)
    basis = spec.vectors[:, :rank]  # U_r [m, r]
    down = basis.T @ weighted  # [r, H]
    if row_weight.dim() == 1 and bool((row_weight > 0).all()):
        values = spec.values[:rank]
        seen = values > values.max().clamp_min(0) * values.shape[0] * torch.finfo(values.dtype).eps  # as (AΣAᵀ)⁺
        up = basis * seen / row_weight[:, None]
    else:
        up = least_squares_up(target, down, metric)
    return Latent(down=down, up=up, energy=spec.energy(rank))


def weigh(row_weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """row_weight·target for a diagonal (vector) or full row weight."""
    return row_weight @ target if row_weight.dim() == 2 else row_weight[:, None] * target


def least_squares_up(target: torch.Tensor, down: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """argmin_B ‖(T − B·A)Σ½‖: B = TΣAᵀ(AΣAᵀ)⁺, computed with a pseudo-inverse for rank-deficient A."""
    cross = metric_math.times(target, metric) @ down.T  # [m, r]
    gram = metric_math.times(down, metric) @ down.T  # [r, r]
    gram = 0.5 * (gram + gram.T)
    values, vectors = torch.linalg.eigh(gram)
    cutoff = values.max().clamp_min(0) * gram.shape[0] * torch.finfo(gram.dtype).eps
    inv = torch.where(values > cutoff, 1.0 / values.clamp_min(torch.finfo(gram.dtype).tiny), torch.zeros_like(values))
    return cross @ (vectors * inv) @ vectors.T


def relative_error(target: torch.Tensor, approx: torch.Tensor, metric: torch.Tensor) -> float:
    """‖(T − T̂)Σ½‖² / ‖TΣ½‖²: the measured relative output error on inputs with second moment Σ."""
    num = metric_math.total_energy(target - approx, metric)
    den = metric_math.total_energy(target, metric)
    return num / den if den > 0 else 0.0
