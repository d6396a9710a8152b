"""Step 1 of a layer's conversion: the one shared rotated key.

Per RoPE frequency the KV heads are mixed into one rotated component (``rope.head_mix``), weighed by what losing
its rotation costs the query heads (the unrotation cost 1 − |μ|², times the query energy when query-weighted);
the frequencies that fill the R/2 slots are chosen; what each key loses (its remainder) goes to the latent, and
the NoPE query sees the mean rotation μ in its place.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mlaconv.mla import metric as metric_math
from mlaconv.mla import rope
from mlaconv.mla.layer import AttentionShape, LayerOptions, LayerStats


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


def unrotation_cost(stats: LayerStats) -> torch.Tensor:
    """[F, N]: E|e^{-iΔω} − μ|² = 1 − |μ|², what losing the rotation of a component at frequency j costs
    head h when the component then sees the mean rotation μ instead."""
    return (1 - stats.rotation_mean.abs() ** 2).clamp_min(0).T


def key_mix(k: torch.Tensor, q: torch.Tensor | None, shape: AttentionShape, stats: LayerStats,
            options: LayerOptions) -> tuple[torch.Tensor, rope.HeadMix]:
    """Per frequency, the best mix of the KV heads into one rotated component → (complex keys, mix).

    Each KV head weighs by what losing its rotation costs the query heads it serves: the unrotation
    cost, times the query energy when ``query_weighted_rope``.
    """
    zk = rope.complex_pairs(k, shape.kv_heads)  # [F, n_kv, H]
    gram = rope.hermitian_gram(zk, stats.metric)
    cost = unrotation_cost(stats)  # [F, N]
    if options.query_weighted_rope:
        cost = cost * query_energy_per_head(q, shape, stats.metric)
    weights = cost.reshape(cost.shape[0], shape.kv_heads, shape.group).sum(-1)
    return zk, rope.head_mix(gram, weights)


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
