"""The shared RoPE key: which key components keep their rotation, and how heads are mixed for it.

Notation: n_kv KV heads of size d, H hidden, F = d/2 RoPE frequencies. A source key in the
Hugging Face rotate-half layout pairs dims (j, j + d/2) into frequency j; we view that pair as one
complex number z = k[j] + i·k[j + d/2], which RoPE multiplies by e^{i·pos·ω_j}.

Mixing the n_kv heads of one frequency with complex coefficients commutes with that rotation, so
for each frequency we can pull out one shared component κ_j = Σ_g b_g·z_g that stays exactly
rotated, and write every head's key as z_g = a_g·κ_j + r_g. The best (a, b) is the top eigenvector
of the (query-weighted) Hermitian Gram of the heads at that frequency (TransMLA's RoRoPE is the
real-valued special case). The DeepSeek-V3 layout has R/2 rotary slots at frequencies θ'^(-2i/R),
a geometric grid, so the kept frequencies are j_i = s·i for a stride s, with θ' = θ^(s·R/d).
The remainders r_g lose their rotation and join the joint latent with the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlaconv.mla import metric as metric_math

PRIOR_POWER = 0.5  # data-free attention profile ∝ (1 + Δ)^-0.5, see prior_rotation_mean


def complex_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads·d, H] rotate-half rows → [F, heads, H] complex rows (pair j = rows j and j + d/2)."""
    d = w.shape[0] // heads
    w = w.reshape(heads, d, -1)
    return torch.complex(w[:, : d // 2], w[:, d // 2 :]).transpose(0, 1)


def real_rows(z: torch.Tensor) -> torch.Tensor:
    """Inverse of ``complex_pairs`` for one set of heads: [F, heads, H] complex → [heads·d, H] real."""
    F, heads, H = z.shape
    out = torch.cat([z.real, z.imag], dim=0)  # [d, heads, H] with pair j at rows (j, j + F)
    return out.transpose(0, 1).reshape(heads * 2 * F, H)


def hermitian_gram(z: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """E[z_g · conj(z_g')] for complex rows z [F, n, H] and the input metric E[x xᵀ] (see ``metric``) → [F, n, n]."""
    return metric_math.times(z, metric) @ z.conj().transpose(-1, -2)


@dataclass(frozen=True)
class HeadMix:
    """Per frequency, the shared component κ_j = Σ_g b[j,g]·z_g and the share a[j,g] each head takes back.

    energies [F, n_kv]: eigenvalues (descending) of the weighted Gram; energies[:, 0] is what the
    shared component can carry at each frequency.
    """

    a: torch.Tensor  # [F, n_kv] complex
    b: torch.Tensor  # [F, n_kv] complex
    energies: torch.Tensor  # [F, n_kv] real


def head_mix(gram: torch.Tensor, head_weights: torch.Tensor | None = None) -> HeadMix:
    """Best rank-one mix per frequency of a Hermitian Gram [F, n, n], optionally query-weighted.

    With D = diag(head_weights[j]) (the query energy each KV head serves), the kept part a·(bᴴz)
    minimises Σ_g D_g E|z_g − a_g κ|²: u = top eigenvector of D½ G D½, a = D^-½ u, b = conj(D½ u).
    b is normalised to unit length so that κ has the magnitude of one head's key.
    """
    F, n, _ = gram.shape
    if head_weights is None:
        head_weights = torch.ones(F, n, dtype=gram.real.dtype)
    root = head_weights.clamp_min(torch.finfo(head_weights.dtype).tiny).sqrt()
    weighted = root[:, :, None] * gram * root[:, None, :]
    energies, vectors = torch.linalg.eigh(weighted)  # ascending
    energies, vectors = energies.flip(-1).clamp_min(0), vectors.flip(-1)
    u = vectors[:, :, 0]
    a = u / root
    b = (u * root).conj()
    norm = b.abs().pow(2).sum(-1, keepdim=True).sqrt().clamp_min(torch.finfo(root.dtype).tiny)
    return HeadMix(a=a * norm, b=b / norm, energies=energies)


def prior_rotation_mean(freqs: torch.Tensor, window: int, power: float = PRIOR_POWER) -> torch.Tensor:
    """μ_j = E[e^{-iΔω_j}] under a data-free attention profile → [F] complex128.

    Each query at position m < window attends to distance Δ ≤ m with weight ∝ (1 + Δ)^-power:
    attention is mostly local but keeps a long tail (attention sinks sit at every distance). Used
    where no calibration measured the real profile.
    """
    distance = torch.arange(window, dtype=torch.float64)
    weight = (1 + distance) ** -power
    # Σ over query positions m ≥ Δ of weight(Δ) / Σ_{Δ' ≤ m} weight(Δ'), averaged over the window.
    per_query = (1 / weight.cumsum(0)).flip(0).cumsum(0).flip(0)
    profile = weight * per_query / window  # [window], sums to 1
    return (profile.to(torch.complex128)[:, None] * torch.exp(-1j * distance[:, None] * freqs[None, :])).sum(0)


def strides(head_dim: int, rope_dim: int) -> list[int]:
    """Strides s for which the grid j_i = s·i (i < R/2) fits in the d/2 source frequencies."""
    slots, freqs = rope_dim // 2, head_dim // 2
    if slots == 1:  # the grid always starts at the fastest frequency, j = 0
        return [1]
    return [s for s in range(1, freqs) if s * (slots - 1) <= freqs - 1] or [1]


def kept_frequencies(rope_dim: int, stride: int) -> torch.Tensor:
    return torch.arange(rope_dim // 2) * stride


def folded_turn(freqs: torch.Tensor, rope_dim: int, stride: int, context: int) -> float:
    """The most any frequency the R/2 slots leave out (folded into the latent at its mean rotation) turns over
    ``context`` positions, in radians: ω·context, 0 when every frequency is kept. freqs [d/2], fastest first."""
    folded = torch.ones(len(freqs), dtype=torch.bool)
    folded[kept_frequencies(rope_dim, stride)] = False
    return float(freqs[folded].max() * context) if folded.any() else 0.0


def least_rope_dim(freqs: torch.Tensor, context: int, turn: float) -> int:
    """The least R whose stride-1 slots keep every frequency that turns by more than ``turn`` radians over
    ``context`` positions (the slowest are the ones folded). freqs [d/2], fastest first."""
    turning = (freqs * context > turn).nonzero()
    return 2 * (int(turning.max()) + 1) if len(turning) else 0


@dataclass(frozen=True)
class RopeChoice:
    """Which source frequencies fill the R/2 slots, and the energy bookkeeping behind the choice."""

    stride: int
    frequencies: torch.Tensor  # [R/2] source frequency index per slot
    energy_kept_per_frequency: list[float]  # per source frequency: fraction of its weighted energy kept
    loss_weighted_kept: float  # fraction of the cost-weighted key energy kept rotated


def stride_scores(energies: torch.Tensor, rope_dim: int) -> dict[int, float]:
    """For every stride that fits: the fraction of the weighted key energy its slots keep rotated.

    energies [F, n_kv] from ``head_mix`` (eigenvalues of the cost-weighted Gram, so a frequency whose
    rotation barely matters weighs little).
    """
    total = energies.sum().item()
    scores = {}
    for s in strides(2 * energies.shape[0], rope_dim):
        kept = energies[kept_frequencies(rope_dim, s), 0].sum().item()
        scores[s] = kept / total if total > 0 else 1.0
    return scores


def best_stride(scores: list[dict[int, float]]) -> int:
    """The stride with the highest mean score over layers (ties: the smaller stride)."""
    candidates = scores[0].keys()
    return max(candidates, key=lambda s: (sum(layer[s] for layer in scores) / len(scores), -s))


def choose_frequencies(energies: torch.Tensor, rope_dim: int, stride: int) -> RopeChoice:
    """The slots' source frequencies for ``stride``, with the weighted energy each keeps rotated."""
    if stride not in strides(2 * energies.shape[0], rope_dim):
        raise ValueError(f"stride {stride} does not fit {rope_dim} rope dims in {energies.shape[0]} frequencies")
    tiny = torch.finfo(energies.dtype).tiny
    per_freq_total = energies.sum(-1)
    idx = kept_frequencies(rope_dim, stride)
    per_freq = torch.zeros_like(per_freq_total)
    per_freq[idx] = energies[idx, 0] / per_freq_total[idx].clamp_min(tiny)
    return RopeChoice(stride=stride, frequencies=idx, energy_kept_per_frequency=per_freq.tolist(),
                      loss_weighted_kept=stride_scores(energies, rope_dim)[stride])


def target_rope_theta(theta: float, head_dim: int, rope_dim: int, stride: int) -> float:
    """θ' with θ'^(-2i/R) = θ^(-2·s·i/d): the DeepSeek base that reproduces the kept frequencies."""
    return float(theta ** (stride * rope_dim / head_dim))


def source_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    """ω_j = θ^(-2j/d) for j < d/2 (before any rope_scaling, which acts per frequency)."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def interleave(z: torch.Tensor) -> torch.Tensor:
    """Complex slot rows [..., slots, H] → real rows [..., 2·slots, H] in DeepSeek's (re, im) pair order."""
    out = torch.stack([z.real, z.imag], dim=-2)  # [..., slots, 2, H]
    return out.reshape(*z.shape[:-2], 2 * z.shape[-2], z.shape[-1])



def scaled_frequencies(theta: float, head_dim: int, rope_scaling: dict | None, length: int | None = None) -> torch.Tensor:
    """The source's actual ω_j after ``rope_scaling`` (linear, llama3 or longrope; all act per frequency).

    ``head_dim`` is the rotary dimension. LongRoPE divides each ω_j by its own factor: the short factors,
    or the long ones for sequences longer than ``original_max_position_embeddings`` (``length``).
    """
    freqs = source_frequencies(theta, head_dim)
    kind = (rope_scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return freqs / float(rope_scaling["factor"])
    if kind == "longrope":
        long = length is not None and length > rope_scaling["original_max_position_embeddings"]
        return freqs / torch.tensor(rope_scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
    if kind == "llama3":
        factor = float(rope_scaling["factor"])
        low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
        original = float(rope_scaling["original_max_position_embeddings"])
        wavelength = 2 * torch.pi / freqs
        smooth = ((original / wavelength - low) / (high - low)).clamp(0, 1)
        blended = (1 - smooth) * freqs / factor + smooth * freqs
        return torch.where(wavelength > original / low, freqs / factor,
                           torch.where(wavelength < original / high, freqs, blended))
    if kind != "default":
        raise ValueError(f"rope type {kind!r} has no per-frequency scaling here (arch.rope_settings refuses it)")
    return freqs


def pair_frequencies(rotating: torch.Tensor, head_dim: int) -> torch.Tensor:
    """ω per rotate-half pair of a whole head [d/2]: the rotating pairs' ω, then 0 for the pairs that pass."""
    return torch.cat([rotating.to(torch.float64), torch.zeros(head_dim // 2 - rotating.shape[0], dtype=torch.float64)])


def target_rope_scaling(rope_scaling: dict | None, kept: torch.Tensor) -> dict | None:
    """The DeepSeek ``rope_scaling`` that reproduces the kept source frequencies on its R/2 slots.

    linear and llama3 act on ω alone and carry over unchanged; LongRoPE's per-pair factors are taken at the
    kept pairs, and its attention factor is 1 (the source's is folded into the query, rotated dims only).
    """
    if not rope_scaling or rope_scaling.get("rope_type") != "longrope":
        return dict(rope_scaling) if rope_scaling else None
    picked = kept.tolist()
    return {**rope_scaling, "short_factor": [rope_scaling["short_factor"][j] for j in picked],
            "long_factor": [rope_scaling["long_factor"][j] for j in picked], "attention_factor": 1.0}


@dataclass(frozen=True)
class UnrotationLoss:
    """What the key remainders' lost rotation costs the scores, with and without the mean-rotation stand-in.

    Cost model (the one the head mix minimises): a remainder component r at frequency j, seen by query head
    h, moves the score by about |q_h^j|·|r^j|·|e^{-iΔω_j} − c|, where c is what the NoPE query puts in place
    of the rotation: c = μ_h,j (what convert does, E|e − μ|² = 1 − |μ|²) or c = 1 (no stand-in, E|e − 1|² =
    2 − 2·Re μ). Both are fractions of Σ_j,h E|q_h^j|²·E|k_g(h)^j|², the query-weighted key energy of the
    rotating pairs, so 0 means nothing lost and the gap is what the stand-in recovers.
    """

    compensated_per_frequency: list[float]  # [F] this pair's share of the loss, with c = μ
    compensated: float
    uncompensated: float

    @property
    def recovered(self) -> float:
        """Fraction of the uncompensated loss the mean rotation removes (1 when nothing is lost)."""
        return 1 - self.compensated / self.uncompensated if self.uncompensated > 0 else 1.0


def unrotation_loss(query_energy: torch.Tensor, key_energy: torch.Tensor, remainder_energy: torch.Tensor,
                    mean: torch.Tensor) -> UnrotationLoss:
    """query_energy [F, N], key_energy and remainder_energy [F, N] (each query head's KV head's, per pair),
    mean μ [N, F] → the ``UnrotationLoss``."""
    return score_loss(query_energy * remainder_energy, (query_energy * key_energy).sum().item(), mean)


def unrotation_cost(mean: torch.Tensor) -> torch.Tensor:
    """μ [N, F] → [F, N]: E|e^{-iΔω} − μ|² = 1 − |μ|², what losing the rotation of a component at frequency j costs
    head h when the component then sees the mean rotation μ instead."""
    return (1 - mean.abs() ** 2).clamp_min(0).T


def score_loss(error: torch.Tensor, total: float, mean: torch.Tensor) -> UnrotationLoss:
    """error [F, N]: each pair's and query head's score error before anything stands in for it; ``total``: the
    query-weighted key energy it is a fraction of; mean μ [N, F] → the ``UnrotationLoss``."""
    compensated = error * unrotation_cost(mean)
    uncompensated = error * (2 - 2 * mean.T.real).clamp_min(0)
    scale = 1 / total if total > 0 else 0.0
    return UnrotationLoss(compensated_per_frequency=(compensated.sum(-1) * scale).tolist(),
                          compensated=compensated.sum().item() * scale, uncompensated=uncompensated.sum().item() * scale)


# --- applying RoPE: every rotation mlaconv computes (calibration, refinement, the runtime, the benches) is one of these


def position_angles(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Angles pos·ω [S, F] for the given positions [S], in float64 (exact for the positions; the caller casts)."""
    return positions.to(torch.float64)[:, None] * freqs.to(device=positions.device, dtype=torch.float64)[None]


def rope_angles(freqs: torch.Tensor, length: int) -> torch.Tensor:
    """Angles pos·ω [S, F] for positions 0..S-1 (float64 for exactness, cast by the caller)."""
    return position_angles(torch.arange(length), freqs)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of pos·inv_freq, each [S, R/2], computed in float64 then cast to ``dtype``."""
    angles = position_angles(positions, inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the (source's) rotate-half layout: pair j = (x[j], x[j + d/2]) of x [..., S, d]; cos/sin [S, d/2]."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_half_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """``rotate_half`` by angles [S, d/2] (cast to x's dtype)."""
    return rotate_half(x, angles.cos().to(x.dtype), angles.sin().to(x.dtype))


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE on interleaved pairs (2i, 2i+1) of x [..., S, R]; cos/sin [S, R/2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
