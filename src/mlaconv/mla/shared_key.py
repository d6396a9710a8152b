"""Step 1 of a layer's conversion: the one shared rotated key.

Per RoPE frequency the KV heads are mixed into one rotated component (``rope.head_mix``), weighed by what losing
its rotation costs the query heads (the unrotation cost 1 − |μ|², times the query energy when query-weighted);
the frequencies that fill the R/2 slots are chosen; what each key loses (its remainder) goes to the latent, and
the NoPE query sees the mean rotation μ in its place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from mlaconv.mla import rope
from mlaconv.mla import metric as metric_math
from mlaconv.mla.layer import AttentionShape, LatentAttention, LayerOptions, LayerStats


def layer_frequencies(shape: AttentionShape, options: LayerOptions, rotated: bool = True) -> torch.Tensor:
    """ω per rotate-half pair of a source layer [d/2]: the rotary dims' frequencies, then 0 for the pairs RoPE
    leaves alone (all of them when the layer is not ``rotated``)."""
    rotary = options.rotary_dim or shape.head_dim
    freqs = rope.scaled_frequencies(options.rope_theta, rotary, options.rope_scaling)
    return rope.pair_frequencies(freqs if rotated else torch.zeros_like(freqs), shape.head_dim)


def rotating_pairs(shape: AttentionShape, options: LayerOptions) -> int:
    """F_rot: how many rotate-half pairs RoPE turns (the first ones); the shared key's slots come from these."""
    return (options.rotary_dim or shape.head_dim) // 2


def weights_only_stats(gamma: torch.Tensor, shape: AttentionShape, options: LayerOptions,
                       rotated: bool = True) -> LayerStats:
    """Statistics without data: ĥ isotropic (E[x xᵀ] = diag γ², kept as its diagonal) and the prior attention profile."""
    freqs = layer_frequencies(shape, options, rotated)
    mean = rope.prior_rotation_mean(freqs, options.context)
    mean[freqs == 0] = 1  # a pair that never turns keeps its whole alignment
    return LayerStats(metric=gamma.to(torch.float64) ** 2, rotation_mean=mean[None, :].expand(shape.heads, -1))


def query_energy_per_head(q: torch.Tensor, shape: AttentionShape, metric: torch.Tensor) -> torch.Tensor:
    """E|q_h^j|² → [F, N]."""
    zq = rope.complex_pairs(q, shape.heads)  # [F, N, H]
    return metric_math.energy(zq, metric)


def per_kv_head(cost: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """[F, N] → [F, n_kv]: summed over the query heads each KV head serves."""
    return cost.reshape(cost.shape[0], shape.kv_heads, shape.group).sum(-1)


def key_mix(k: torch.Tensor, q: torch.Tensor | None, shape: AttentionShape, stats: LayerStats,
            options: LayerOptions) -> tuple[torch.Tensor, rope.HeadMix]:
    """Per frequency, the best mix of the KV heads into one rotated component → (complex keys, mix).

    Each KV head weighs by what losing its rotation costs the query heads it serves: the unrotation
    cost, times the query energy when ``query_weighted_rope``.
    """
    zk = rope.complex_pairs(k, shape.kv_heads)  # [F, n_kv, H]
    gram = rope.hermitian_gram(zk, stats.metric)
    cost = rope.unrotation_cost(stats.rotation_mean)  # [F, N]
    if options.query_weighted_rope:
        cost = cost * query_energy_per_head(q, shape, stats.metric)
    return zk, rope.head_mix(gram, per_kv_head(cost, shape))


def key_energies(k: torch.Tensor, gamma: torch.Tensor, shape: AttentionShape, options: LayerOptions) -> torch.Tensor:
    """[F_rot, n_kv] weights-only energies of the per-frequency head mix (what the rope stride is chosen from).

    Without data and without query weighting the mix depends on the keys and γ alone, not on R.
    """
    stats = weights_only_stats(gamma, shape, options)
    unweighted = replace(options, query_weighted_rope=False)
    return key_mix(k.to(torch.float64), None, shape, stats, unweighted)[1].energies[: rotating_pairs(shape, options)]


def decompose_keys(k: torch.Tensor, q: torch.Tensor, shape: AttentionShape, stats: LayerStats,
                   options: LayerOptions, rotated: bool = True):
    """Split the keys into the shared rotated component and per-head remainders (step 1).

    Slots only take rotating pairs (the first F_rot); a layer that is not ``rotated`` keeps no shared
    component (its rope rows are zero) and every key goes whole into the remainders. ``plain_kept`` is
    the fraction of the rotating pairs' key energy that stays rotated (1 when nothing rotates).
    """
    zk, mix = key_mix(k, q, shape, stats, options)
    if not rotated:
        mix = rope.HeadMix(a=torch.zeros_like(mix.a), b=torch.zeros_like(mix.b), energies=torch.zeros_like(mix.energies))
    rotating = rotating_pairs(shape, options)
    stride = options.rope_stride
    if stride is None:
        stride = rope.best_stride([rope.stride_scores(mix.energies[:rotating], options.rope_dim)])
    choice = rope.choose_frequencies(mix.energies[:rotating], options.rope_dim, stride)
    kept = choice.frequencies
    shared = torch.einsum("sg,sgh->sh", mix.b[kept], zk[kept])  # κ per slot [R/2, H]
    remainder = zk.clone()
    remainder[kept] -= mix.a[kept][:, :, None] * shared[:, None, :]
    total = metric_math.total_energy(zk[:rotating], stats.metric) if rotated else 0.0
    plain_kept = 1 - metric_math.total_energy(remainder[:rotating], stats.metric) / total if total > 0 else 1.0
    return mix, choice, plain_kept, shared, rope.real_rows(remainder)


def nope_query(q: torch.Tensor, shape: AttentionShape, stats: LayerStats) -> torch.Tensor:
    """The NoPE query rows [N·d, H]: the source query times conj(μ) per pair, so that the key remainders
    (which lost their rotation) see the mean rotation instead of none."""
    zq = rope.complex_pairs(q, shape.heads)  # [F, N, H]
    return rope.real_rows(stats.rotation_mean.T.conj()[:, :, None] * zq)


# --- what a converted layer's rotated part keeps, for any weights (docs/report.md, "Rotary figures") ---------------


@dataclass(frozen=True)
class RotatedSlots:
    """A layer's rotated part as complex pairs, in the source's score units: slot i turns at source pair
    ``frequencies[i]``, and head h scores Re((q̂_h,i·x_m)·conj(κ_i·x_n)·e^{iΔω}) there, as the source's pair scores
    Re((z_q·x_m)·conj(z_k·x_n)·e^{iΔω})."""

    frequencies: torch.Tensor  # [R/2] source pair index per slot
    query: torch.Tensor  # q̂ [R/2, N, H] complex
    key: torch.Tensor  # κ [R/2, H] complex


def closed_form_slots(q: torch.Tensor, mix: rope.HeadMix, choice: rope.RopeChoice, shared: torch.Tensor,
                      shape: AttentionShape) -> RotatedSlots:
    """The closed form's rotated part before it is assembled: κ, and each head's query share conj(a_g)·z_q."""
    kept, group_of_head = choice.frequencies, torch.arange(shape.heads) // shape.group
    zq = rope.complex_pairs(q.to(torch.float64), shape.heads)[kept]  # [R/2, N, H] (a bfloat16 source too)
    return RotatedSlots(kept, mix.a[kept][:, group_of_head].conj()[:, :, None] * zq, shared)


def latent_slots(latent: LatentAttention, shape: AttentionShape, rope_dim: int,
                 frequencies: torch.Tensor) -> RotatedSlots:
    """The rotated part of a compact layer (closed form or refined): its interleaved q_rope [N·R, H] and k_rope
    [R, H] rows as complex slots, the query without the √((d+R)/d) its rows carry for the softmax scale."""
    N, d, R = shape.heads, shape.head_dim, rope_dim

    def pairs(rows: torch.Tensor) -> torch.Tensor:  # [..., R, H] interleaved → [..., R/2, H] complex
        rows = rows.reshape(*rows.shape[:-2], R // 2, 2, rows.shape[-1]).to(torch.float64)
        return torch.complex(rows[..., 0, :], rows[..., 1, :])

    query = pairs(latent.q_rope.reshape(N, R, -1)).transpose(0, 1) * math.sqrt(d / (d + R))
    return RotatedSlots(frequencies, query, pairs(latent.k_rope))


@dataclass(frozen=True)
class RotaryFigures:
    """What a layer's rotated part keeps of the source's rotating pairs (F_rot of them), in one metric and profile."""

    energy_kept: float  # share of the source's key energy the shared key carries (best multiple per head and pair)
    energy_kept_per_frequency: list[float]  # [F_rot] the same per pair, its heads weighted by the unrotation cost
    loss_weighted_kept: float  # over all pairs, so weighted
    score: rope.UnrotationLoss  # the rotated part's score error, with and without the mean-rotation stand-in


def inner(a: torch.Tensor, b: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """E[(a·x)·conj(b·x)] for complex rows a, b [..., H] (broadcast) → [...]."""
    return (metric_math.times(a, metric) * b.conj()).sum(-1)


@dataclass(frozen=True)
class SourceRotation:
    """The source's side of ``rotary_figures``, the same for every version of a layer: its rotating pairs' energies
    in one metric and what losing each pair's rotation costs under μ (small: [F, N] each)."""

    shape: AttentionShape
    metric: torch.Tensor  # E[x xᵀ] [H, H] in float64 (or its diagonal)
    mean: torch.Tensor  # μ [N, F] complex128
    query: torch.Tensor  # E|z_q|² [F, N]
    key: torch.Tensor  # E|z_k|² [F, n_kv]
    weight: torch.Tensor  # Σ over each KV head's query heads of (1 − |μ|²) × query energy [F, n_kv]


def source_rotation(q: torch.Tensor, k: torch.Tensor, shape: AttentionShape, pairs: int, metric: torch.Tensor,
                    mean: torch.Tensor) -> SourceRotation:
    """The ``SourceRotation`` of source rows q [N·d, H], k [n_kv·d, H] over their first ``pairs`` pairs."""
    metric = metric.to(torch.float64)
    query = metric_math.energy(_pairs(q, shape.heads, pairs), metric)  # [F, N]
    key = metric_math.energy(_pairs(k, shape.kv_heads, pairs), metric)  # [F, n_kv]
    mean = mean[:, :pairs].to(torch.complex128)
    weight = per_kv_head(rope.unrotation_cost(mean) * query, shape)
    return SourceRotation(shape, metric, mean, query, key, weight)


def nothing_rotates(pairs: int) -> RotaryFigures:
    """The figures of a layer whose source turns no pair: nothing to keep, nothing lost."""
    return RotaryFigures(1.0, [1.0] * pairs, 1.0, rope.UnrotationLoss([0.0] * pairs, 0.0, 0.0))


def rotary_figures(q: torch.Tensor, k: torch.Tensor, shape: AttentionShape, pairs: int, slots: RotatedSlots,
                   metric: torch.Tensor, mean: torch.Tensor, rotated: bool = True) -> RotaryFigures:
    """The ``RotaryFigures`` of a layer's rotated part ``slots`` against the source rows q [N·d, H] and k [n_kv·d, H],
    with x of second moment ``metric`` (query and key inputs independent) and attention profile μ [N, d/2].

    Per pair j, query head h and its KV head g, the score error is c = (z_q·x_m)·conj(z_k·x_n) − (q̂·x_m)·conj(κ·x_n)
    (all of the source's score where no slot turns at j): E|c|² is the rotated part's error before anything stands
    in for it; E|c|²·(1 − |μ|²) remains when the NoPE part adds the best position-free term c·μ, E|c|²·(2 − 2·Re μ)
    when it adds c as if Δ were 0. Both are fractions of Σ E|z_q|²·E|z_k|². For the closed form in its own
    statistics every figure is the one its construction reports (``decompose_keys``, ``rope.unrotation_loss``).
    """
    if not rotated:
        return nothing_rotates(pairs)
    return figures_against(source_rotation(q, k, shape, pairs, metric, mean), q, k, slots)


def figures_against(source: SourceRotation, q: torch.Tensor, k: torch.Tensor, slots: RotatedSlots) -> RotaryFigures:
    """``rotary_figures`` with the source's side computed already (one ``SourceRotation`` for every version)."""
    shape, metric = source.shape, source.metric
    group_of_head, j = torch.arange(shape.heads) // shape.group, slots.frequencies
    zq, zk = _kept_pairs(q, shape.heads, j), _kept_pairs(k, shape.kv_heads, j)  # [R/2, N, H], [R/2, n_kv, H]
    kappa, q_hat = slots.key.to(torch.complex128), slots.query.to(torch.complex128)  # [R/2, H], [R/2, N, H]
    kappa_energy = metric_math.energy(kappa, metric)  # [R/2]
    along = inner(zk, kappa[:, None], metric)  # E[z_k·conj κ] [R/2, n_kv]
    kept = torch.zeros_like(source.key)
    kept[j] = along.abs() ** 2 / kappa_energy.clamp_min(torch.finfo(torch.float64).tiny)[:, None]
    error = source.query * source.key[:, group_of_head]  # [F, N]
    total = error.sum().item()
    error[j] = (error[j] + metric_math.energy(q_hat, metric) * kappa_energy[:, None]
                - 2 * (inner(zq, q_hat, metric) * along[:, group_of_head].conj()).real).clamp_min(0)
    weight, key = source.weight, source.key
    per_frequency = (weight * kept).sum(-1) / (weight * key).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    return RotaryFigures(
        energy_kept=_share(kept.sum().item(), key.sum().item()),
        energy_kept_per_frequency=per_frequency.tolist(),
        loss_weighted_kept=_share((weight * kept).sum().item(), (weight * key).sum().item()),
        score=rope.score_loss(error, total, source.mean))


def _pairs(rows: torch.Tensor, heads: int, pairs: int) -> torch.Tensor:
    return rope.complex_pairs(rows.to(torch.float64), heads)[:pairs]


def _kept_pairs(rows: torch.Tensor, heads: int, kept: torch.Tensor) -> torch.Tensor:
    """``_pairs`` at the ``kept`` pairs only, only their rows widened to float64 → [len(kept), heads, H]."""
    d = rows.shape[0] // heads
    rows = rows.reshape(heads, d, -1)
    halves = torch.cat([rows[:, kept], rows[:, kept + d // 2]], dim=1)  # rotate-half rows of the kept pairs
    return rope.complex_pairs(halves.reshape(-1, rows.shape[-1]).to(torch.float64), heads)


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 1.0
