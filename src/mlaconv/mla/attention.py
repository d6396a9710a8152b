"""One attention layer, MHA/GQA → DeepSeek-V3 MLA: the whole conversion of a layer's weights.

Source (Llama layout): N query heads and n_kv KV heads of size d, hidden H, rotate-half RoPE.
Target (DeepSeek-V3, ``q_lora_rank = null``): P = V = d NoPE/value dims per head, R shared RoPE
dims, latent rank r:

    input_layernorm     [H]            s·γ: the attention input is scaled by a power of two s ≤ 1
    q_proj              [N·(d+R), H]   per head: d NoPE rows (the source query), R rope rows; all ÷ s
    kv_a_proj_with_mqa  [r+R, H]       β·A (latent), then the shared rope key κ (interleaved pairs); all ÷ s
    kv_a_layernorm      [r]            constant ρ: with the tiny latent the norm is linear
    kv_b_proj           [N·2d, r]      per head: d key rows, then d value rows (GQA groups expanded)
    o_proj              [H, N·d]

Steps: (1) mix KV heads per frequency into one rotated component and choose the frequencies that fill
the R/2 slots (``shared_key``); (2) the rest of every key (its remainder) loses rotation
and, stacked with V, is factored into one rank-r latent (``latent.factor``); (3) the query is
re-expressed for that key layout, with the softmax-scale change (d+R)^-½ vs d^-½ folded in;
(4) biases are folded where that is exact, and everything else is recorded; (5) the stock tensors, with
the latent's smallness split between kv_a's weights and the attention input (``latent_norm``).
All math runs in ``LayerOptions.precision`` (float64 unless the caller asks for float32); the caller casts the result.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from mlaconv.mla import rope
from mlaconv.mla import latent as latent_math
from mlaconv.mla import metric as metric_math
from mlaconv.mla.latent_norm import input_scale, tiny_latent
from mlaconv.mla.layer import (AttentionShape, LatentAttention, LayerOptions, LayerReport, LayerStats, MLAAttention,
                               SourceAttention)
from mlaconv.mla.shared_key import decompose_keys, nope_query, weights_only_stats


def constant_readout(stats: LayerStats) -> torch.Tensor | None:
    """w [H] with wᵀx ≈ 1 in the least-squares sense over the calibration inputs (w = E[x xᵀ]⁻¹E[x]): how a
    bias-free layer best reads a constant off its input. None without calibration data."""
    if stats.mean is None or stats.metric.dim() != 2:
        return None
    metric = stats.metric + 1e-9 * stats.metric.diagonal().mean() * torch.eye(stats.metric.shape[0], dtype=stats.metric.dtype)
    return torch.linalg.solve(metric, stats.mean.to(metric.dtype))


def full_rank(shape: AttentionShape, rope_dim: int) -> int:
    """The largest useful latent rank: rows of [K_nope; V] (the source's cache less the R rope dims) or the hidden
    size, whichever is smaller."""
    return min(shape.hidden, shape.cache_elements - rope_dim)


def block_norm(w: torch.Tensor, metric: torch.Tensor) -> float:
    return math.sqrt(max(metric_math.total_energy(w, metric), 0.0))


def attention_row_weights(q_nope: torch.Tensor, o: torch.Tensor, shape: AttentionShape,
                          metric: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head g, (Σ_h E[q_h q_hᵀ])½ for its NoPE key and (Σ_h W_o,hᵀW_o,h)½ for its value → 2 × [n_kv, d, d].

    An error Δk in head g's key moves the scores of its query heads by q_h·Δk, and an error Δv
    moves the output by W_o,h·Δv: these roots turn ‖Δ‖ into what the attention actually sees.
    """
    N, G, d = shape.heads, shape.kv_heads, shape.head_dim
    q = q_nope.reshape(N, d, -1)
    query_moment = (metric_math.times(q, metric) @ q.transpose(1, 2)).reshape(G, shape.group, d, d).sum(1)
    o_heads = o.reshape(o.shape[0], N, d).transpose(0, 1)  # [N, H, d]
    output_moment = (o_heads.transpose(1, 2) @ o_heads).reshape(G, shape.group, d, d).sum(1)
    return metric_math.symmetric_root(query_moment), metric_math.symmetric_root(output_moment)


def latent_target(k_nope: torch.Tensor, v: torch.Tensor, stats: LayerStats, options: LayerOptions,
                  q: torch.Tensor, o: torch.Tensor, shape: AttentionShape):
    """The stacked target [K_nope; V] and the row weights that choose its latent basis (step 2).

    Row weights are a vector (diagonal) for "balanced", a block-diagonal matrix for "attention" (from the NoPE
    query of the source query rows ``q``); either way the K and V blocks are scaled to equal weighted energy, then
    the V block's energy by ``options.value_weight``.
    """
    target = torch.cat([k_nope, v], dim=0)
    if options.latent_weighting == "attention":
        key_root, value_root = attention_row_weights(nope_query(q, shape, stats), o, shape, stats.metric)
        key_weight, value_weight = torch.block_diag(*key_root), torch.block_diag(*value_root)
        nk, nv = block_norm(key_weight @ k_nope, stats.metric), block_norm(value_weight @ v, stats.metric)
    else:  # identity weights (I·x is x exactly, so no product is formed)
        nk, nv = block_norm(k_nope, stats.metric), block_norm(v, stats.metric)
    # A block with (numerically) no energy, e.g. MQA keys that all stay rotated, is not blown up:
    # it is scaled like the other block. "No energy" is relative to the rounding of the precision used.
    scale, empty = max(nk, nv, 1e-300), max(1e-9, 1e3 * torch.finfo(target.dtype).eps)
    nk, nv = (nk if nk > empty * scale else scale), (nv if nv > empty * scale else scale)
    nv = nv / options.value_weight ** 0.5
    if options.latent_weighting == "attention":
        return target, torch.block_diag(key_weight / nk, value_weight / nv)
    return target, torch.cat([k_nope.new_ones(k_nope.shape[0]) / nk, v.new_ones(v.shape[0]) / nv])


@dataclass
class LayerAnalysis:
    """Everything about one layer that does not depend on the latent rank: what ``inspect`` shows."""

    mix: rope.HeadMix
    choice: rope.RopeChoice
    rope_energy_kept: float  # fraction of the plain key energy that stays rotated (1 − remainder energy)
    shared: torch.Tensor  # κ per slot [R/2, H] complex
    k_nope: torch.Tensor  # [n_kv·d, H]
    target: torch.Tensor  # [K_nope; V] [2·n_kv·d, H]
    row_weight: torch.Tensor  # [2·n_kv·d] (diagonal) or [2·n_kv·d, 2·n_kv·d]
    spectrum: latent_math.Spectrum  # of the exact matrix the latent truncates


def in_precision(src: SourceAttention, shape: AttentionShape, options: LayerOptions,
                 stats: LayerStats | None) -> tuple[SourceAttention, LayerStats]:
    """The layer and its statistics (the data-free ones without calibration) in ``options.precision``."""
    src = src.cast(dtype=options.precision)
    stats = stats if stats is not None else weights_only_stats(src.input_norm, shape, options, src.rotated)
    return src, stats.cast(options.precision)


def analyse_layer(src: SourceAttention, shape: AttentionShape, options: LayerOptions,
                  stats: LayerStats | None = None) -> LayerAnalysis:
    """RoPE split and the latent's spectrum for one layer (copies of ``src`` in ``options.precision`` are used)."""
    if src.has_qk_norm:
        raise ValueError("a layer with QK-norm is not linear: factor its linear stand-in (mla.qk_norm) instead")
    src, stats = in_precision(src, shape, options, stats)
    mix, choice, plain_kept, shared, k_nope = decompose_keys(src.k, src.q, shape, stats, options, src.rotated)
    target, row_weight = latent_target(k_nope, src.v, stats, options, src.q, src.o, shape)
    spec = latent_math.spectrum(latent_math.weigh(row_weight, target), stats.metric)
    return LayerAnalysis(mix, choice, plain_kept, shared, k_nope, target, row_weight, spec)


def factor_attention(src: SourceAttention, shape: AttentionShape, options: LayerOptions,
                     stats: LayerStats | None = None) -> tuple[LatentAttention, LayerReport]:
    """Steps 1–4 of the conversion: the compact linear MLA layer and what it kept (in ``options.precision``)."""
    src, stats = in_precision(src, shape, options, stats)
    N, G, d, R, r = shape.heads, shape.kv_heads, shape.head_dim, options.rope_dim, options.rank
    group_of_head = torch.arange(N) // shape.group

    readout = constant_readout(stats) if not options.biases else None
    value_bias_folded = readout is not None and src.v_bias is not None and bool(src.v_bias.abs().max() > 0)
    if value_bias_folded:  # b_v ≈ b_v·(wᵀx): the value bias joins the value rows (W_o·b_v leaves o_proj.bias)
        src = replace(src, v=src.v + src.v_bias[:, None] * readout[None, :], v_bias=None)
    layer = analyse_layer(src, shape, options, stats)
    mix, choice, k_nope, spec = layer.mix, layer.choice, layer.k_nope, layer.spectrum
    kept = choice.frequencies
    lat = latent_math.factor(layer.target, layer.row_weight, stats.metric, r, spec)
    up_k, up_v = lat.up[: G * d], lat.up[G * d :]

    # Query: rope rows take each head's share conj(a) of the shared key; NoPE rows see the remainders.
    q_scale = math.sqrt((d + R) / d)
    zq = rope.complex_pairs(src.q, N)  # [F, N, H]
    q_rope = mix.a[kept][:, group_of_head].conj()[:, :, None] * zq[kept]  # [R/2, N, H]
    q_rope = rope.interleave(q_rope.transpose(0, 1)).reshape(N * R, -1)  # [N·R, H]

    k_rope_bias = o_bias = None
    dropped: list[str] = []
    if src.k_bias is not None:
        zb = rope.complex_pairs(src.k_bias[:, None], G)[..., 0]  # [F, n_kv]
        k_rope_bias = rope.interleave((mix.b[kept] * zb[kept]).sum(-1)[:, None])[:, 0]  # κ's bias per slot
        # The remainder of the key bias only adds q·b to every score of a query: softmax drops it exactly.
    if src.q_bias is not None and src.q_bias.abs().max() > 0:
        dropped.append("q_proj.bias")  # DeepSeek-V3's q_proj has no bias in any stack
    if src.v_bias is not None or src.o_bias is not None:
        o_bias = torch.zeros(src.o.shape[0], dtype=src.o.dtype)
        if src.v_bias is not None:  # Σ softmax = 1, so a value bias adds W_o·b_v to the output
            o_bias += src.o @ src.v_bias.reshape(G, d)[group_of_head].reshape(N * d)
        if src.o_bias is not None:
            o_bias += src.o_bias
    k_rope_folded = None
    if not options.biases:
        for name, bias in (("kv_a_proj_with_mqa.bias", k_rope_bias), ("o_proj.bias", o_bias)):
            if (bias is not None and bias.abs().max() > 0) or (name == "o_proj.bias" and value_bias_folded):
                dropped.append(name)
        if readout is not None and k_rope_bias is not None:  # the rope key's bias read off the input the same way
            k_rope_folded = k_rope_bias[:, None] * readout[None, :]
        k_rope_bias = o_bias = None

    latent = LatentAttention(
        q_nope=nope_query(src.q, shape, stats) * q_scale, q_rope=q_rope * q_scale, down=lat.down,
        k_rope=rope.interleave(layer.shared) + (0 if k_rope_folded is None else k_rope_folded), up_k=up_k, up_v=up_v, o=src.o, k_rope_bias=k_rope_bias, o_bias=o_bias,
        k_nope_target=k_nope,
    )
    key_error, value_error, energy = latent_errors(k_nope, src.v, up_k, up_v, lat.down, stats.metric)
    report = LayerReport(
        energy_retained=energy,
        rope_energy_kept=layer.rope_energy_kept,
        rope_energy_kept_per_frequency=choice.energy_kept_per_frequency,
        rope_loss_weighted_kept=choice.loss_weighted_kept,
        rope_stride=choice.stride,
        key_error=key_error,
        value_error=value_error,
        latent_bound=float("nan"),
        dropped_bias=dropped,
        objective_retained=lat.energy,
    )
    return latent, report


def latent_errors(k_nope: torch.Tensor, v: torch.Tensor, up_k: torch.Tensor, up_v: torch.Tensor, down: torch.Tensor,
                  metric: torch.Tensor) -> tuple[float, float, float]:
    """(key_error, value_error, energy_retained) of a latent c = down·x for the NoPE keys k_nope ≈ up_k·c and the
    values v ≈ up_v·c, in ``metric``.

    energy_retained is 1 − the balanced [K_nope; V] relative error: with K_nope and V scaled to equal energy
    that is 1 − the mean of the key and value errors (a block without energy, such as MQA keys that all stay
    rotated, is left out, as the balanced latent leaves it out). One definition for every variant; for the
    balanced latent in its own metric it equals the spectrum's energy at rank r. What a variant's own weighting
    keeps is ``LayerReport.objective_retained``.

    A block without energy (at most 1e-9 of the other's) has no relative error of its own: its target is rounding
    noise, and noise over noise can read anything (10 on an exact MQA layer). Its error is measured against that
    floor instead, 1e-9 of the other block's energy: a reconstruction that is zero to rounding reads 0, one that
    puts real energy where the source has none reads large.
    """
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in (k_nope, v, up_k, up_v, down)))
    down = down.to(dtype)
    blocks = [(k_nope.to(dtype), up_k.to(dtype) @ down), (v.to(dtype), up_v.to(dtype) @ down)]
    energies = [metric_math.total_energy(target, metric) for target, _ in blocks]
    floor = 1e-9 * max(energies)
    errors = [metric_math.total_energy(target - approx, metric) / max(energy, floor) if max(energy, floor) > 0
              else 0.0 for (target, approx), energy in zip(blocks, energies)]
    kept = [error for error, energy in zip(errors, energies) if energy > floor]
    return errors[0], errors[1], (1 - sum(kept) / len(kept)) if kept else 1.0


def assemble(latent: LatentAttention, shape: AttentionShape, options: LayerOptions, gamma: torch.Tensor,
             metric: torch.Tensor) -> tuple[MLAAttention, float]:
    """Step 5: the stock DeepSeek-V3 tensors — tiny latent behind ``kv_a_layernorm``, its smallness split
    between kv_a and the input norm, GQA groups expanded, the residual rescale on o_proj. Returns them
    and the proven bound on mean(c'²)/ε."""
    N, G, d, R, r = shape.heads, shape.kv_heads, shape.head_dim, options.rope_dim, options.rank
    group_of_head = torch.arange(N) // shape.group
    dtype = options.precision
    down = latent.down.to(dtype)
    typical_rms = math.sqrt(max(metric_math.total_energy(down, metric), 0.0) / r)
    tiny = tiny_latent(down, gamma.to(dtype), typical_rms, delta=options.delta)
    q_proj = torch.cat([latent.q_nope.reshape(N, d, -1), latent.q_rope.reshape(N, R, -1)], dim=1)
    kv_b = torch.stack([latent.up_k.reshape(G, d, r), latent.up_v.reshape(G, d, r)], dim=1)  # [G, 2, d, r]
    kv_a_bias = None
    if latent.k_rope_bias is not None:
        kv_a_bias = torch.cat([torch.zeros(r, dtype=dtype), latent.k_rope_bias.to(dtype)])
    mla = MLAAttention(
        q_proj=q_proj.reshape(N * (d + R), -1).to(dtype),
        kv_a_proj=torch.cat([tiny.beta * down, latent.k_rope.to(dtype)], dim=0),
        kv_a_norm=torch.full((r,), tiny.norm_weight, dtype=dtype),
        kv_b_proj=kv_b[group_of_head].reshape(N * 2 * d, r).to(dtype) * tiny.up_scale,
        o_proj=latent.o.to(dtype) * options.residual_scale,
        input_norm=gamma.to(dtype),
        kv_a_bias=kv_a_bias,
        o_bias=None if latent.o_bias is None else latent.o_bias.to(dtype) * options.residual_scale,
    )
    return scale_input(mla, r, metric), tiny.bound


def scale_input(mla: MLAAttention, rank: int, metric: torch.Tensor) -> MLAAttention:
    """The same attention reading s·x (``latent_norm.input_scale``): input norm ×s, q_proj and kv_a ÷s.

    Every score, value and the latent c' are unchanged (s·x enters only through those two weights; the
    rope-key bias is added after them), and so is the bound on mean(c'²), a function of kv_a·diag(γ).
    """
    hidden = mla.input_norm.shape[0]
    input_rms = math.sqrt(max((metric.diagonal() if metric.dim() == 2 else metric).sum().item(), 0.0) / hidden)
    s = input_scale(mla.kv_a_proj[:rank], [mla.q_proj, mla.kv_a_proj], input_rms)
    # q_proj and kv_a are assemble's own fresh tensors: divided in place, no second copy of q_proj
    return replace(mla, q_proj=mla.q_proj.div_(s), kv_a_proj=mla.kv_a_proj.div_(s), input_norm=mla.input_norm * s)


def convert_attention(src: SourceAttention, shape: AttentionShape, options: LayerOptions,
                      stats: LayerStats | None = None) -> tuple[MLAAttention, LayerReport]:
    """Convert one layer (steps 1–5); all inputs are cast to ``options.precision`` first."""
    src, stats = in_precision(src, shape, options, stats)
    latent, report = factor_attention(src, shape, options, stats)
    mla, report.latent_bound = assemble(latent, shape, options, src.input_norm, stats.metric)
    return mla, report
