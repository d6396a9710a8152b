"""Layer-wise refinement: gradient steps on one converted layer's attention-output error.

The closed-form conversion optimises proxies (K/V reconstruction, rotation left unrotated). What the model
sees is the attention output, a nonlinear function of all the factors at once. Starting from the closed form,
Adam steps (150 by default; on a slow CPU fewer, of one window) on ‖MLA(x) − source(x)‖² / ‖source(x)‖² over
calibration windows move the factors (queries, down- and up-projections, the shared RoPE key) towards what the
attention actually needs; W_o and the biases stay fixed. The steps train on the calibration's fit windows; the
best step is chosen, and kept only if it beats the closed form, on its select windows (never the ones that
train it). Shapes: x [B, S, H]; N heads, n_kv KV heads, d, R, r.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mlaconv.mla.layer import LatentAttention

from mlaconv.mla.forward import causal_attention, rms_norm
from mlaconv.mla.layer import AttentionShape
from mlaconv.mla.rope import rotate_interleaved

CHECK_EVERY = 10  # steps between two measurements on the select windows
REFINE_LR = 3e-2  # relative learning rate to start from (with BACKOFF; bench/refine/README.md, issue 16)
REFINE_BATCH = 8  # training windows per step
QUERY_SHARE = 8  # a step's error is taken at 1/QUERY_SHARE of each window's positions: 150 steps of 8 windows so
# measured better on the select windows than 75 of 4 at every position, in less work where the query side is most
# of it, i.e. in wide layers (bench/refine/README.md, issue 16)
BACKOFF = 3.0  # a check that does not beat the best state goes back to it and divides the rate by this
CHUNK_SCORES = 2**25  # attention scores a chunk of windows may hold (128 MB a copy in float32): windows run through
# the layer a chunk at a time and only a chunk's activations are held (a step of 8 windows of 2048 with 32 heads at an
# eighth of the positions: 0.5 GB a copy, so chunks of 2; small layers take whole batches). The checks, at every
# position, are sized the same way although their fused causal kernel holds no scores: one window at a time there.


def latent_attention(x: torch.Tensor, p: dict[str, torch.Tensor], fixed: LatentAttention, shape: AttentionShape,
                     rope_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                     queries: torch.Tensor | None = None) -> torch.Tensor:
    """The linear MLA layer on x [B, S, H] → [B, S, H], with the trainable factors taken from ``p``; with
    ``queries`` (sorted positions [Q]) only the outputs at those positions → [B, Q, H]."""
    B, S, _ = x.shape
    N, d, R = shape.heads, shape.head_dim, rope_dim
    xq, cq, sq = x, cos, sin
    if queries is not None:
        xq, cq, sq = x[:, queries], cos[queries], sin[queries]
    Q = xq.shape[1]
    q_nope = F.linear(xq, p["q_nope"]).view(B, Q, N, d).transpose(1, 2)
    q_rope = rotate_interleaved(F.linear(xq, p["q_rope"]).view(B, Q, N, R).transpose(1, 2), cq, sq)
    latent = F.linear(x, p["down"])  # [B, S, r]
    bias = None if fixed.k_rope_bias is None else fixed.k_rope_bias.to(x.dtype)
    k_rope = rotate_interleaved(F.linear(x, p["k_rope"], bias), cos, sin)  # [B, S, R]
    if queries is None:
        out = _expanded_attention(q_nope, q_rope, latent, k_rope, p, shape)
    else:
        mask = queries[:, None] >= torch.arange(S, device=x.device)[None, :]  # [Q, S] causal
        attend = _attention_in_latent if _in_latent(shape, latent.shape[-1], S, Q) else _expanded_attention
        out = attend(q_nope, q_rope, latent, k_rope, p, shape, mask)
    o_bias = None if fixed.o_bias is None else fixed.o_bias.to(x.dtype)
    return F.linear(out.transpose(1, 2).reshape(B, Q, N * d), fixed.o.to(x.dtype), o_bias)


def _expanded_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                        p: dict[str, torch.Tensor], shape: AttentionShape,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with every KV head's keys and values formed from the latent: q [B, N, Q, ·] → [B, N, Q, d]."""
    B, N, _, R = q_rope.shape
    S, G, d = latent.shape[1], shape.kv_heads, shape.head_dim
    k_nope = F.linear(latent, p["up_k"]).view(B, S, G, d).transpose(1, 2).repeat_interleave(N // G, dim=1)
    v = F.linear(latent, p["up_v"]).view(B, S, G, d).transpose(1, 2).repeat_interleave(N // G, dim=1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(B, N, S, R)], dim=-1)
    if mask is None:
        return causal_attention(q, k, v)  # scale (d+R)^-½
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _attention_in_latent(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                         p: dict[str, torch.Tensor], shape: AttentionShape, mask: torch.Tensor) -> torch.Tensor:
    """The same attention with up_k and up_v absorbed into the query and the output (what MLA engines decode
    with): every head scores [c; k_rope] and averages c, so no per-head key or value is formed — less work when
    few queries meet a wide latent shared by many KV heads. q [B, N, Q, ·], mask [Q, S] → [B, N, Q, d]."""
    B, N, Q, R = q_rope.shape
    G, d, r = shape.kv_heads, shape.head_dim, latent.shape[-1]
    up_k = p["up_k"].view(G, d, r).repeat_interleave(N // G, dim=0)  # [N, d, r]
    up_v = p["up_v"].view(G, d, r).repeat_interleave(N // G, dim=0)
    q = torch.cat([q_nope @ up_k, q_rope], dim=-1).reshape(B, 1, N * Q, r + R)  # heads side by side as queries
    k = torch.cat([latent, k_rope], dim=-1)[:, None]  # [B, 1, S, r+R]
    averaged = F.scaled_dot_product_attention(q, k, latent[:, None], attn_mask=mask.repeat(N, 1),
                                              scale=(d + R) ** -0.5)  # [B, 1, N·Q, r]
    return averaged.view(B, N, Q, r) @ up_v.transpose(1, 2)


def _expanded_work(shape: AttentionShape, rank: int, window: int, queries: int) -> int:
    """Multiply-adds of K and V from the latent and of the scores and averages at width d, per window."""
    N, G, d = shape.heads, shape.kv_heads, shape.head_dim
    return window * rank * 2 * G * d + 2 * N * queries * window * d


def _in_latent(shape: AttentionShape, rank: int, window: int, queries: int) -> bool:
    """Whether the attention at ``queries`` positions is less work formed in the latent than expanded."""
    return _latent_work(shape, rank, window, queries) < _expanded_work(shape, rank, window, queries)


def _latent_work(shape: AttentionShape, rank: int, window: int, queries: int) -> int:
    """… of the same in the latent: scores and averages at width r, and each head's query in and output out."""
    N, d = shape.heads, shape.head_dim
    return 2 * N * queries * window * rank + 2 * N * queries * d * rank


@dataclass(frozen=True)
class NormalizedWindows:
    """The attention inputs x = rms_norm(h)·γ [B, S, H] of some windows of a residual stream, formed a batch at a
    time when indexed (by a slice or an index tensor) instead of held whole: while a layer refines, its training
    windows' inputs take no memory of their own (48 windows of 2048 at hidden 2048: 0.8 GB)."""

    hidden: torch.Tensor  # [W, S, H] the residual stream of every window
    windows: torch.Tensor  # [B] which of them
    weight: torch.Tensor  # γ [H], on ``device``
    eps: float
    device: torch.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.windows), *self.hidden.shape[1:]))

    def __getitem__(self, pick: slice | torch.Tensor) -> torch.Tensor:
        pick = pick.cpu() if isinstance(pick, torch.Tensor) else pick
        return rms_norm(self.hidden[self.windows[pick]].to(self.device), self.weight, self.eps)


@dataclass
class Refinement:
    latent: LatentAttention
    before: float  # relative attention error of the closed form on the select windows
    after: float  # … of the best step (== before when no step did better)
    steps: int


def refine(latent: LatentAttention, shape: AttentionShape, rope_dim: int, slot_frequencies: torch.Tensor,
           train: tuple[torch.Tensor | NormalizedWindows, torch.Tensor], select: tuple[torch.Tensor, torch.Tensor],
           steps: int, lr: float = REFINE_LR, check_every: int = CHECK_EVERY, batch: int = REFINE_BATCH, seed: int = 0,
           backoff: float | None = BACKOFF, queries: int | None = None, before: float | None = None) -> Refinement:
    """Adam on the trainable factors of ``latent``; (x, source output) pairs as [B, S, H] float32 tensors (the
    training inputs may be ``NormalizedWindows``).

    Each step uses ``batch`` training windows drawn with a fixed seed; each factor's learning rate is
    ``lr`` times its RMS, so steps are relative to the factor's scale. With ``queries``, a step's error is taken at
    that many random positions of each window (the same ones in every window of the step): keys and values are
    still formed over the whole window, but the query side (the query projections, the scores, W_o), which is most
    of a wide layer's work, shrinks with it. Every ``check_every`` steps (and after the last) the error on
    ``select`` is measured at every position; the best measured state, the closed form included, is returned.
    ``before`` is the closed form's error on ``select`` where the caller has measured it already (that measurement,
    a forward pass over every select window, is then not repeated).
    With ``backoff``, a check that is not the best so far restarts Adam from the best state at the rate divided
    by ``backoff``: the select windows choose the rate as they choose the step (a high rate is fast where it
    works; on small calibration sets it is not, and this is how the steps find out).
    """
    x_train, y_train = train
    x_select, y_select = select
    device, S = y_train.device, y_train.shape[1]
    angles = torch.arange(S, dtype=torch.float64, device=device)[:, None] * slot_frequencies.to(device)[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    fixed = replace(latent, o=latent.o.float().to(device),
                    k_rope_bias=None if latent.k_rope_bias is None else latent.k_rope_bias.float().to(device),
                    o_bias=None if latent.o_bias is None else latent.o_bias.float().to(device))
    params = {name: t.detach().float().to(device).clone().requires_grad_(True) for name, t in latent.trainable().items()}
    optimizer = torch.optim.Adam([{"params": [t], "lr": lr * t.detach().pow(2).mean().sqrt().item()}
                                  for t in params.values()])

    def error(x: torch.Tensor | NormalizedWindows, y: torch.Tensor, rows: torch.Tensor, at: torch.Tensor | None = None,
              train: bool = False) -> float:
        """‖MLA(x) − y‖² / ‖y‖² over the windows ``rows`` (at positions ``at``), a chunk of windows at a time; with
        ``train`` each chunk's share is back-propagated as soon as it is formed (the shares' gradients add up to
        the whole error's), so that only one chunk's activations are held at once."""
        def target(part: torch.Tensor) -> torch.Tensor:
            return y[part] if at is None else y[part][:, at]

        total, measured = target(rows).pow(2).sum(), 0.0
        chunk = max(1, CHUNK_SCORES // (shape.heads * (S if at is None else len(at)) * S))
        for part in rows.split(chunk):
            share = (latent_attention(x[part], params, fixed, shape, rope_dim, cos, sin, at) - target(part)).pow(2).sum()
            share = share / total
            if train:
                share.backward()
            measured += share.item()
        return measured

    every_select = torch.arange(y_select.shape[0], device=device)
    if before is None:
        with torch.no_grad():
            before = error(x_select, y_select, every_select)
    best = before
    best_params = {name: t.detach().clone() for name, t in params.items()}
    generator = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        pick = torch.randperm(y_train.shape[0], generator=generator)[:batch].to(device)
        optimizer.zero_grad()
        at = None
        if queries is not None and queries < S:
            at = torch.randperm(S, generator=generator)[:queries].sort().values.to(device)
        error(x_train, y_train, pick, at, train=True)
        optimizer.step()
        if step % check_every == 0 or step == steps:
            with torch.no_grad():
                measured = error(x_select, y_select, every_select)
            if measured < best:
                best = measured
                best_params = {name: t.detach().clone() for name, t in params.items()}
            elif backoff is not None and step < steps:
                with torch.no_grad():
                    for name, t in params.items():
                        t.copy_(best_params[name])
                optimizer.state.clear()
                for group in optimizer.param_groups:
                    group["lr"] /= backoff
    refined = replace(latent, **{name: t.to("cpu", torch.float64) for name, t in best_params.items()})
    return Refinement(latent=refined, before=before, after=best, steps=steps)


def refinement_flops(shape: AttentionShape, rope_dim: int, rank: int, windows: int, window: int,
                     queries: int | None = None) -> float:
    """Rough multiply-adds ×2 of one forward+backward step over ``windows`` windows of ``window`` tokens, the
    error taken at ``queries`` positions of each (all when None), with the attention formed as ``latent_attention``
    forms it."""
    N, d, H, R = shape.heads, shape.head_dim, shape.hidden, rope_dim
    queries = window if queries is None else min(queries, window)
    key_side = window * H * (rank + R)  # the latent and the rotated key
    query_side = queries * (H * N * (d + R) + H * N * d + window * N * R)  # q, W_o and the rotary scores
    in_latent = queries < window and _in_latent(shape, rank, window, queries)  # ``refine`` takes all positions expanded
    attend = (_latent_work if in_latent else _expanded_work)(shape, rank, window, queries)
    return 3 * 2 * windows * (key_side + query_side + attend)
