"""Reference forwards of one decoder block, from weight tensors: the source (Llama-style) and MLA attention.

Calibration runs the source model through these one layer at a time (so only one layer's weights
are in memory), and measures how far a candidate MLA attention is from the source attention on the
same inputs. Shapes: B windows, S tokens, H hidden; N heads, n_kv KV heads, d head dim.
Tests check the source forward against transformers' own model classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mlaconv.mla.layer import AttentionShape, MLAAttention, SourceAttention
from mlaconv.mla.rope import rotate_half_pairs, rotate_interleaved


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, *, in_dtype: bool = False) -> torch.Tensor:
    """RMSNorm, its mean square computed in float32 (or the input's dtype if wider). By default the weight multiplies in
    that wide dtype, and the caller casts; ``in_dtype`` (DeepSeek-V3's order in transformers, what the latent runtime
    runs) casts the normalised input back to ``h``'s dtype first and multiplies it by the weight as it is."""
    dtype = torch.promote_types(h.dtype, torch.float32)
    x = h.to(dtype)
    if in_dtype:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return weight.to(dtype) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA, scale (q's head dim)^-½. Where v's heads are narrower than q's (MLA: d against d + R) v is
    zero-padded to q's width and the padding cut from the output: the same attention, but torch's fused kernel
    only takes equal widths, and on a CPU its fallback holds every score (8 windows of 2048 with 32 heads: 4.3 GB
    a copy, and several copies; bench/results/conversion-memory-recipe-windows.json)."""
    narrow = q.shape[-1] - v.shape[-1]
    if narrow <= 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, F.pad(v, (0, narrow)), is_causal=True)[..., : v.shape[-1]]


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))


def query_key(x: torch.Tensor, w: SourceAttention, heads: AttentionShape) -> tuple[torch.Tensor, torch.Tensor]:
    """The source's queries [B, N, S, d] and keys [B, n_kv, S, d] on x [B, S, H], before RoPE; a layer with
    QK-norm RMS-normalises each head (Qwen3's q_norm, k_norm)."""
    B, S, _ = x.shape
    N, G, d = heads.heads, heads.kv_heads, heads.head_dim
    q = _linear(x, w.q, w.q_bias).view(B, S, N, d)
    k = _linear(x, w.k, w.k_bias).view(B, S, G, d)
    if w.q_norm is not None:
        q = rms_norm(q, w.q_norm, w.qk_norm_eps).to(x.dtype)
    if w.k_norm is not None:
        k = rms_norm(k, w.k_norm, w.qk_norm_eps).to(x.dtype)
    return q.transpose(1, 2), k.transpose(1, 2)


def source_attention(x: torch.Tensor, w: SourceAttention, heads: AttentionShape, angles: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of the source on normalised input x [B, S, H] → [B, S, H] (before the residual)."""
    B, S, _ = x.shape
    N, G, d = heads.heads, heads.kv_heads, heads.head_dim
    q, k = query_key(x, w, heads)
    v = _linear(x, w.v, w.v_bias).view(B, S, G, d).transpose(1, 2)
    q, k = rotate_half_pairs(q, angles), rotate_half_pairs(k, angles)
    k, v = k.repeat_interleave(N // G, dim=1), v.repeat_interleave(N // G, dim=1)
    out = causal_attention(q, k, v)  # scale d^-½
    return _linear(out.transpose(1, 2).reshape(B, S, N * d), w.o, w.o_bias)


def mla_attention(x: torch.Tensor, w: MLAAttention, heads: AttentionShape, rank: int, rope_dim: int,
                  angles: torch.Tensor, latent_eps: float = 1e-6) -> torch.Tensor:
    """DeepSeek-V3 attention (q_lora_rank null, interleaved RoPE) on x [B, S, H] → [B, S, H].

    x is this layer's own attention input: the hidden state after the converted input norm ``w.input_norm``
    (not the source's γ; see ``mlaconv.mla.latent_norm``)."""
    B, S, _ = x.shape
    N, d, R = heads.heads, heads.head_dim, rope_dim
    q = _linear(x, w.q_proj).view(B, S, N, d + R).transpose(1, 2)
    q_nope, q_rope = q[..., :d], q[..., d:]
    compressed = _linear(x, w.kv_a_proj, w.kv_a_bias)
    latent = rms_norm(compressed[..., :rank], w.kv_a_norm, latent_eps).to(x.dtype)
    k_rope = compressed[..., rank:].unsqueeze(1)  # [B, 1, S, R], shared by all heads
    kv = _linear(latent, w.kv_b_proj).view(B, S, N, 2 * d).transpose(1, 2)
    k_nope, v = kv[..., :d], kv[..., d:]
    cos, sin = angles.cos().to(q_rope.dtype), angles.sin().to(q_rope.dtype)
    q_rope, k_rope = rotate_interleaved(q_rope, cos, sin), rotate_interleaved(k_rope, cos, sin)
    k = torch.cat([k_nope, k_rope.expand(B, N, S, R)], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    out = causal_attention(q, k, v)  # scale (d+R)^-½ as DeepSeek
    return _linear(out.transpose(1, 2).reshape(B, S, N * d), w.o_proj, w.o_bias)


@dataclass
class MLPWeights:
    gate: torch.Tensor  # [F, H]
    up: torch.Tensor  # [F, H]
    down: torch.Tensor  # [H, F]
    post_attention_norm: torch.Tensor  # [H]


def mlp_block(h: torch.Tensor, w: MLPWeights, eps: float) -> torch.Tensor:
    """SwiGLU MLP on the residual h [B, S, H] (its pre-norm included) → the MLP's output."""
    x = rms_norm(h, w.post_attention_norm, eps).to(h.dtype)
    return _linear(F.silu(_linear(x, w.gate)) * _linear(x, w.up), w.down)


def attention_by_distance(x: torch.Tensor, w: SourceAttention, heads: AttentionShape, angles: torch.Tensor,
                          max_scores: int = 2**25) -> torch.Tensor:
    """Σ over windows and queries of the attention each head pays at distance Δ = m − n → [N, S].

    Heads are processed in chunks so that at most ``max_scores`` attention scores exist at once.
    """
    B, S, _ = x.shape
    N, G, d = heads.heads, heads.kv_heads, heads.head_dim
    q, k = (rotate_half_pairs(t, angles) for t in query_key(x, w, heads))
    k = k.repeat_interleave(N // G, dim=1)
    causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    distance = (torch.arange(S, device=x.device)[:, None] - torch.arange(S, device=x.device)[None, :]).clamp_min(0)
    by_distance = torch.zeros(N, S, dtype=x.dtype, device=x.device)
    chunk = max(1, max_scores // (B * S * S))
    for h in range(0, N, chunk):
        scores = (q[:, h : h + chunk] @ k[:, h : h + chunk].transpose(-1, -2)) * d**-0.5  # [B, c, S, S]
        probs = scores.masked_fill_(~causal, float("-inf")).softmax(-1).sum(0)  # [c, S, S]
        by_distance[h : h + chunk].index_add_(1, distance.flatten(), probs.flatten(1))
    return by_distance
