"""Baseline GQA/MHA → DeepSeek-V3 MLA converters for the fidelity bench.

Both write a checkpoint with exactly mlaconv's serving shapes and plumbing (``bench.baselines.plumbing``): the same
(r, R) from ``plan_shapes``, full-rank ``q_proj`` with the softmax-scale fix √((d+R)/d), the shared RoPE key on a
strided frequency grid in interleaved pairs (``rope.interleave``, ``target_rope_theta``), the tiny-latent
``kv_a_layernorm`` (``tiny_latent``, its smallness split with the input norm by ``scale_input``), the
residual-stream ε rescale, the same bias folds, ``build_config``, and mlaconv's layer loop and writer, each as a
conversion pipeline registered under its name (``JointSVD``, ``TransMLA``; ``PartialRoPE`` is TransMLA's stage A).
Only the factorization differs:

``joint-svd`` — MHA2MLA's initialisation made expressible in the DeepSeek layout (weights only).
    The shared RoPE key is the head-averaged key at the kept frequencies 0, s, 2s, … (s = d / R by
    default; X-EcoMLA's W^KR from the mean of the KV heads' W_K); every query head rotates against it with its own
    source query rows. What each head's key loses to that mean, and all other frequencies, stay in
    source coordinates and, stacked with W_V, go through one plain truncated SVD of the raw weights
    (no balancing, no whitening, no input-norm γ), Σ on the up-projection.

``transmla`` — TransMLA's pipeline (arXiv 2502.07864, as its code does it; see the research note):
    calibration activations → RoRoPE + FreqFold (per group of ``freqfold`` adjacent frequencies, one
    real PCA across the KV heads' (re, im) samples shared by the re and im halves; the top
    ``freqfold / collapse`` components keep RoPE at frequencies collapse·i, collapse = d / R) →
    recalibration of that partial-RoPE model → BKV (NoPE keys divided by the ratio of mean column
    norms) → joint activation PCA of [K_nope / ratio; V] truncated to r → the RoPE part of the key
    up-projection absorbed into the query. "PCA" is theirs: eigenvectors of the uncentered second
    moment of the module outputs (bias included) plus 0.01·mean(diag) damping, in float64.
    ``freqfold=None`` is their ``auto``: try collapse, 2·collapse, … while the partial-RoPE model's
    perplexity improves — measured here on the calibration windows (theirs used the test split).
    Adaptations to the stock layout, none of which changes the factorization: the latent goes
    through the tiny-latent norm (TransMLA ships code that skips the norm); the latent carries no
    bias — the NoPE key bias is dropped (softmax ignores it) and W_o·b_v goes to ``o_proj.bias``, as
    mlaconv does (TransMLA projects both into a truncated latent bias). In every method a q bias is
    dropped and reported (stock DeepSeek-V3 has no ``q_proj.bias``).

QK-norm (Qwen3's q_norm / k_norm on each head): neither pipeline has a place for it. Both take the raw
q_proj / k_proj rows and drop the norms, as TransMLA's converter does (its output model has no q_norm /
k_norm; TransMLA issue #22: Qwen3 PPL 8 → 50,000+). ``convert_transmla(..., qk_norm="stand-in")`` instead
gives TransMLA mlaconv's least-squares linear stand-ins (``mla.qk_norm``, fitted on the same calibration
ids) in place of the normalised heads: that separates what the stand-in does from what the rest of
mlaconv does.

Calibration ids [n, w] are run through the model loaded whole (``AutoModelForCausalLM``, float32):
a forward pre-hook on every ``self_attn.q_proj`` collects the second moment of the attention input
x = γ ⊙ ĥ; every activation statistic used is a quadratic form in it.

    from bench.baselines.methods import convert_joint_svd, convert_transmla
    convert_joint_svd("examples/stories260K", "out/svd50", kv_keep=0.5)
    convert_transmla("examples/stories260K", "out/tm50", calib_ids, kv_keep=0.5)
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from bench.baselines.plumbing import (Baseline, Factorization, baseline_plan, plan_baseline, read_layers,
                                      write_baseline)
from mlaconv.conversion.pipelines import Pipeline, register
from mlaconv.conversion.plan import Plan, ShapeChoice
from mlaconv.io.models import load_causal_lm
from mlaconv.mla import rope
from mlaconv.mla.layer import AttentionShape, SourceAttention

PCA_DAMPING = 0.01  # TransMLA's pca_calc: + 0.01·mean(diag) on the diagonal


# ------------------------------------------------------------------------------------------- joint SVD


def joint_svd_layer(src: SourceAttention, shape: AttentionShape, rope_dim: int, rank: int,
                    stride: int) -> Factorization:
    """Head-averaged shared RoPE key + plain truncated SVD of [K_rest; V] (raw weights, Σ on the up side)."""
    N, G, d = shape.heads, shape.kv_heads, shape.head_dim
    kept = rope.kept_frequencies(rope_dim, stride)  # [R/2] source frequency of each slot
    zk = rope.complex_pairs(src.k.double(), G)  # [F, G, H]
    shared = zk[kept].mean(1)  # [R/2, H]
    rest = zk.clone()
    rest[kept] -= shared[:, None]  # what each head's key differs from the mean loses its rotation
    target = torch.cat([rope.real_rows(rest), src.v.double()])  # [2·G·d, H]
    u, s, vh = torch.linalg.svd(target, full_matrices=False)
    up = u[:, :rank] * s[:rank]  # [2·G·d, r]
    q_rope = rope.interleave(rope.complex_pairs(src.q.double(), N)[kept].transpose(0, 1))  # [N, R, H]
    bias = None
    if src.k_bias is not None:
        zb = rope.complex_pairs(src.k_bias.double()[:, None], G)  # [F, G, 1]
        bias = rope.interleave(zb[kept].mean(1))[:, 0]  # [R]
    return Factorization(q_rope=q_rope, k_rope=rope.interleave(shared), k_rope_bias=bias, down=vh[:rank],
                         up_k=up[: G * d].reshape(G, d, rank), up_v=up[G * d :].reshape(G, d, rank))


@register("joint-svd")
class JointSVD(Pipeline):
    """``joint_svd_layer`` on each layer, at the plan's shapes and rope stride."""

    def __init__(self, plan: Plan):
        super().__init__(plan)
        shapes, stride = plan.shapes, plan.layer.rope_stride
        self.step = Baseline(plan.spec, lambda _, src: joint_svd_layer(src, plan.shape, shapes.rope_dim, shapes.rank,
                                                                        stride))


def convert_joint_svd(source: str | Path, out: str | Path, *, kv_keep: float | None = None, rank: int | None = None,
                      rope_dim: int | None = None, rope_stride: int | None = None, dtype: str = "float32") -> dict:
    """Write the ``joint-svd`` baseline of ``source`` to ``out``; returns its report (also in baseline.json).

    Shapes as ``mlaconv convert`` (exactly one of kv_keep / rank; rope_dim optional). ``rope_stride``
    defaults to d // R, TransMLA's frequency subset spread over the whole spectrum (no optimisation);
    pass mlaconv's chosen stride to compare at equal frequencies. QK-norm is dropped (no data to fit a stand-in).
    """
    started = time.perf_counter()
    spec, shapes = plan_baseline(source, rank, kv_keep, rope_dim)
    stride = rope_stride or default_stride(spec.head_dim, shapes.rope_dim)
    return write_baseline("joint-svd", baseline_plan(source, shapes, stride, dtype), out, started)


def default_stride(head_dim: int, rope_dim: int) -> int:
    """d // R (TransMLA's subset: every (d/R)-th frequency, spread out), else the widest grid that fits."""
    fitting = rope.strides(head_dim, rope_dim)
    return head_dim // rope_dim if head_dim // rope_dim in fitting else max(fitting)


# -------------------------------------------------------------------------------------------- TransMLA


@torch.no_grad()
def attention_input_moments(folder: str | Path, ids: torch.Tensor, batch_size: int = 8) -> list[torch.Tensor]:
    """Per layer S = Σ_t x̃ x̃ᵀ [H+1, H+1] (float64) of the attention input x̃ = [x; 1], over ids [n, w].

    The model is loaded whole through ``AutoModelForCausalLM`` (float32); a forward pre-hook on each
    ``self_attn.q_proj`` sees x. The constant 1 carries the biases: the second moment of the outputs
    W x + b is W̃ S W̃ᵀ with W̃ = [W | b].
    """
    model = load_causal_lm(folder, torch.float32)
    layers = model.model.layers
    hidden = model.config.hidden_size
    moments = [torch.zeros(hidden + 1, hidden + 1, dtype=torch.float64) for _ in layers]

    def hook(i: int) -> Callable:
        def accumulate(module, args):  # noqa: ARG001 - hook signature
            x = args[0].reshape(-1, hidden).double()
            x = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
            moments[i] += x.T @ x
        return accumulate

    handles = [layer.self_attn.q_proj.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for batch in ids.split(batch_size):
            model.model(input_ids=batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return moments


def augmented(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W̃ = [W | b] [out, H+1] in float64 (b = 0 without a bias)."""
    column = bias.double()[:, None] if bias is not None else torch.zeros(len(weight), 1, dtype=torch.float64)
    return torch.cat([weight.double(), column], dim=1)


def pca(cov: torch.Tensor) -> torch.Tensor:
    """TransMLA's ``pca_calc``: eigenvectors (columns, eigenvalues descending) of cov + 0.01·mean(diag)·I."""
    cov = 0.5 * (cov + cov.T)
    cov = cov + PCA_DAMPING * cov.diagonal().mean() * torch.eye(len(cov), dtype=cov.dtype)
    return torch.linalg.eigh(cov).eigenvectors.flip(-1)


def rorope_basis(k: torch.Tensor, moment: torch.Tensor, shape: AttentionShape, rope_dim: int,
                  freqfold: int) -> torch.Tensor:
    """RoRoPE + FreqFold → an orthogonal basis Q [G·d, G·d] of the stacked key rows (rotate-half layout).

    k: W̃_k [G·d, H+1]; moment: S [H+1, H+1]. Columns 2i, 2i+1 are slot i's (re, im) rope component,
    slot i at source frequency collapse·i; columns R… are the components that lose RoPE. Group q is
    frequencies q·ff … q·ff + ff − 1 of every KV head: one PCA whose samples are the real and the
    imaginary halves (the same U for both, so a rotation shared by the group commutes with it); its
    top ff / collapse components fill the group's slots, the strongest at the fastest frequency.
    """
    G, d = shape.kv_heads, shape.head_dim
    F, slots = d // 2, freqfold // (d // rope_dim)  # slots per group
    basis = torch.zeros(G * d, G * d, dtype=torch.float64)
    free = rope_dim  # next NoPE column
    for q in range(F // freqfold):
        re = (torch.arange(G)[:, None] * d + torch.arange(q * freqfold, (q + 1) * freqfold)).flatten()  # [G·ff]
        im = re + F
        u = pca(k[re] @ moment @ k[re].T + k[im] @ moment @ k[im].T)  # [G·ff, G·ff]
        for m in range(len(re)):
            if m < slots:
                col_re = 2 * (q * slots + m)
            else:
                col_re, free = free, free + 2
            basis[re, col_re] = u[:, m]
            basis[im, col_re + 1] = u[:, m]
    return basis


def transmla_layer(src: SourceAttention, shape: AttentionShape, basis: torch.Tensor, rope_dim: int,
                   moment: torch.Tensor | None, rank: int | None) -> Factorization:
    """The rotated keys of ``basis`` → one layer (BKV + joint activation PCA at ``rank``).

    With ``moment=None`` the latent is the identity on [K_nope; V] (rank 2·G·d − R): TransMLA's
    stage-A "partial RoPE" model, exact apart from the lost rotations.
    """
    N, G, d, R = shape.heads, shape.kv_heads, shape.head_dim, rope_dim
    k_rot = basis.T @ augmented(src.k, src.k_bias)  # [G·d, H+1]: rope components, then NoPE ones
    v = augmented(src.v, src.v_bias)  # [G·d, H+1]
    k_nope, back = k_rot[R:], basis[:, R:]  # NoPE outputs [G·d − R, H+1]; back to key rows [G·d, G·d − R]
    if moment is None:
        kv_basis, ratio = torch.eye(len(k_nope) + len(v), dtype=torch.float64), 1.0
    else:
        ratio = bkv_ratio(k_nope, v, moment)
        joint = torch.cat([k_nope / ratio, v])  # [2·G·d − R, H+1]
        kv_basis = pca(joint @ moment @ joint.T)[:, :rank]
    down = kv_basis.T @ torch.cat([k_nope / ratio, v])[:, :-1]  # [r, H] (the biases are folded by ``assemble``)
    up = torch.block_diag(back * ratio, torch.eye(G * d, dtype=torch.float64)) @ kv_basis  # [2·G·d, r]
    r = down.shape[0]
    # q_h·k_g = (Q_gᵀ q_h)·(Qᵀ k): the rope rows of each head absorb its KV head's block of the basis
    head_basis = basis.reshape(G, d, G * d)[torch.arange(N) // shape.group, :, :R]  # [N, d, R]
    q_rope = torch.einsum("ndr,ndh->nrh", head_basis, src.q.double().reshape(N, d, -1))  # [N, R, H]
    k_rope_bias = k_rot[:R, -1] if src.k_bias is not None else None
    return Factorization(q_rope=q_rope, k_rope=k_rot[:R, :-1], k_rope_bias=k_rope_bias, down=down,
                         up_k=up[: G * d].reshape(G, d, r), up_v=up[G * d :].reshape(G, d, r))


def bkv_ratio(k_nope: torch.Tensor, v: torch.Tensor, moment: torch.Tensor) -> float:
    """TransMLA's BKV: mean over NoPE key dims i of ‖K_nope[:, i]‖₂ over tokens / the same for V (1 if none)."""
    if len(k_nope) == 0:
        return 1.0

    def mean_column_norm(w: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ih,hk,ik->i", w, moment, w).clamp_min(0).sqrt().mean()

    return (mean_column_norm(k_nope) / mean_column_norm(v)).item()


def freqfold_candidates(head_dim: int, rope_dim: int) -> list[int]:
    """collapse, 2·collapse, 4·collapse, … while the groups tile the d/2 frequencies (TransMLA's auto order)."""
    collapse, candidates = head_dim // rope_dim, []
    ff = collapse
    while ff <= head_dim // 2 and (head_dim // 2) % ff == 0:
        candidates.append(ff)
        ff *= 2
    return candidates


@register("transmla-partial-rope")
class PartialRoPE(Pipeline):
    """TransMLA's stage A: each layer's keys rotated by its basis (``layers`` and ``bases`` in layer order) and the
    identity latent, exact apart from the lost rotations (``transmla_layer`` without moments)."""

    def __init__(self, plan: Plan, layers: list[SourceAttention], bases: list[torch.Tensor]):
        super().__init__(plan)
        R = plan.shapes.rope_dim
        self.step = Baseline(plan.spec, lambda i, src: transmla_layer(src, plan.shape, bases[i], R, None, None), layers)


@register("transmla")
class TransMLA(Pipeline):
    """TransMLA's result: each layer's keys rotated by its basis, then BKV and the joint activation PCA of its
    ``moments`` at the plan's rank (``transmla_layer``)."""

    def __init__(self, plan: Plan, layers: list[SourceAttention], bases: list[torch.Tensor],
                 moments: list[torch.Tensor]):
        super().__init__(plan)
        R, r = plan.shapes.rope_dim, plan.shapes.rank
        self.step = Baseline(plan.spec, lambda i, src: transmla_layer(src, plan.shape, bases[i], R, moments[i], r),
                             layers)


def convert_transmla(source: str | Path, out: str | Path, calib_ids: torch.Tensor, *, kv_keep: float | None = None,
                     rank: int | None = None, rope_dim: int | None = None, freqfold: int | None = None,
                     batch_size: int = 8, dtype: str = "float32", qk_norm: str = "dropped") -> dict:
    """Write the ``transmla`` baseline of ``source`` to ``out``, calibrated on ``calib_ids`` [n, w].

    Shapes as ``mlaconv convert``; R must divide d (collapse = d // R). ``freqfold=None`` searches
    collapse·2^k while the partial-RoPE model's calibration perplexity improves (TransMLA's auto);
    the report lists every perplexity tried. ``qk_norm``: "dropped" (TransMLA's own behaviour) or
    "stand-in" (mlaconv's linear stand-ins, fitted on ``calib_ids``).
    """
    started = time.perf_counter()
    if qk_norm not in ("dropped", "stand-in"):
        raise ValueError(f"qk_norm must be 'dropped' or 'stand-in', got {qk_norm!r}")
    spec, shapes = plan_baseline(source, rank, kv_keep, rope_dim)
    layers = read_layers(source, calib_ids if qk_norm == "stand-in" else None)
    shape = spec.attention_shape
    d, R = spec.head_dim, shapes.rope_dim
    if d % R:
        raise ValueError(f"TransMLA needs qk_rope_head_dim ({R}) to divide head_dim ({d})")
    candidates = freqfold_candidates(d, R)
    if freqfold is not None and freqfold not in candidates:
        raise ValueError(f"freqfold {freqfold} must be one of {candidates} (a multiple of d/R dividing d/2)")
    source_moments = attention_input_moments(source, calib_ids, batch_size)  # stage A calibration
    partial_shapes = ShapeChoice(rank=shape.cache_elements - R, rope_dim=R, reason="TransMLA stage A: partial RoPE")
    bases: dict[int, list[torch.Tensor]] = {}
    search: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="transmla-") as tmp:
        for ff in [freqfold] if freqfold is not None else candidates:
            bases[ff] = [rorope_basis(augmented(src.k, src.k_bias), m, shape, R, ff)
                         for src, m in zip(layers, source_moments)]
            write_baseline("transmla-partial-rope", baseline_plan(source, partial_shapes, d // R, "float32"),
                           Path(tmp) / f"ff{ff}", started, layers, bases[ff])
            search[ff] = calibration_perplexity(Path(tmp) / f"ff{ff}", calib_ids, batch_size)
            if len(search) > 1 and search[ff] >= min(list(search.values())[:-1]):
                break  # TransMLA's auto: keep doubling only while the perplexity improves
        best = min(search, key=search.get)
        moments = attention_input_moments(Path(tmp) / f"ff{best}", calib_ids, batch_size)  # stage B recalibration
    calibration = {"windows": len(calib_ids), "window": calib_ids.shape[1]}
    return write_baseline("transmla", baseline_plan(source, shapes, d // R, dtype), out, started, layers, bases[best],
                          moments, freqfold=best, partial_rope_calib_ppl=search, calibration=calibration)


def calibration_perplexity(folder: str | Path, ids: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) of ``folder`` over ids [n, w] (mlaconv's scorer)."""
    from mlaconv.evaluate.perplexity import score_windows

    scores = score_windows(load_causal_lm(folder, torch.float32), list(ids), batch_size)
    return math.exp((scores.nll.sum() / scores.predictions.sum()).item())
