"""MLA attention on a latent cache: the absorbed form the runtime uses, and the expanded reference.

Shapes: B batch, S new tokens, T cached tokens (the S new ones included, at the end), H hidden,
N heads, r latent rank, R rope dims, P NoPE dims, V value dims. A cache row is [ĉ (r) | rotated k^R (R)].
RoPE is interleaved: pair i = dims (2i, 2i+1), turned by pos·inv_freq[i].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaconv.mla.latent_norm import LATENT_NORM_EPS
from mlaconv.mla.layer import MLAAttention, MLAShape
from mlaconv.mla.rope import rotate_interleaved
from mlaconv.target.absorb import AbsorbedAttention


def widened(x: torch.Tensor) -> torch.Tensor:
    """x in float32 at least (softmax and mean squares of bf16 activations run in float32; float64 stays)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def causal_mask(new: int, total: int, device: torch.device) -> torch.Tensor | None:
    """[S, T] bool, True where new token s (position T−S+s) may see cached token t; None when all may."""
    if new == 1:
        return None
    return torch.ones(new, total, dtype=torch.bool, device=device).tril(total - new)


def latent_rows(layer: AbsorbedAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rank: int) -> torch.Tensor:
    """The cache rows of x [B, S, H] → [B, S, r+R]: the latent, then the rotated shared rope key."""
    row = F.linear(x, layer.kv_down, layer.kv_down_bias)  # [B, S, r+R]
    return torch.cat([row[..., :rank], rotate_interleaved(row[..., rank:], cos, sin)], dim=-1)


def attend_latent(query: torch.Tensor, cache: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """Multi-query attention of query [B, N, S, r+R] on cache [B, T, r+R] → o_lat [B, N, S, r].

    Every (head, token) query row of a sequence reads the same cache rows, so per sequence the N·S
    rows form one matrix and the cache is read once: two matrix products (the cache rows are the
    "weight" of the first) with a float32 softmax between them.
    """
    B, N, S, width = query.shape
    T = cache.shape[1]
    mask = causal_mask(S, T, cache.device)
    outputs = []
    for rows, sequence_cache in zip(query.reshape(B, N * S, width), cache):  # [N·S, r+R], [T, r+R]
        scores = F.linear(rows, sequence_cache) * scale  # [N·S, T]
        if mask is not None:
            scores = scores.view(N, S, T).masked_fill(~mask, float("-inf")).view(N * S, T)
        probs = widened(scores).softmax(dim=-1).to(cache.dtype)
        outputs.append(probs @ sequence_cache[:, :rank])  # [N·S, r]
    return torch.stack(outputs).view(B, N, S, rank)


def absorbed_attention(layer: AbsorbedAttention, x: torch.Tensor, cache: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, shape: MLAShape) -> torch.Tensor:
    """Attention output [B, S, H] of x [B, S, H] whose rows are already the last S rows of cache [B, T, r+R]."""
    B, S, H = x.shape
    N, r, R = shape.heads, shape.rank, shape.rope_dim
    q_latent = F.linear(x, layer.q_latent.view(N * r, H)).view(B, S, N, r).transpose(1, 2)  # [B, N, S, r]
    q_rope = F.linear(x, layer.q_rope).view(B, S, N, R).transpose(1, 2)  # [B, N, S, R]
    query = torch.cat([q_latent, rotate_interleaved(q_rope, cos, sin)], dim=-1)  # [B, N, S, r+R]
    o_latent = attend_latent(query, cache, r, shape.softmax_scale)  # [B, N, S, r]
    return F.linear(o_latent.transpose(1, 2).reshape(B, S, N * r), layer.o_latent, layer.o_bias)


def standard_latent_rows(std: MLAAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         shape: MLAShape, linear_norm: bool) -> torch.Tensor:
    """Cache rows [B, S, r+R] as the standard layer makes them: kv_a_layernorm(latent) | rotated rope key.

    ``linear_norm`` uses the linearised norm w⊙c/√ε (the absorbed form's assumption); otherwise the
    RMSNorm as transformers computes it (float32 mean square, ε = 1e-6).
    """
    compressed = F.linear(x, std.kv_a_proj, std.kv_a_bias)  # [B, S, r+R]
    latent, rope_key = compressed[..., : shape.rank], compressed[..., shape.rank:]
    if linear_norm:
        normed = latent * (std.kv_a_norm / LATENT_NORM_EPS**0.5)
    else:
        wide = widened(latent)
        normed = std.kv_a_norm * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + LATENT_NORM_EPS)).to(x.dtype)
    return torch.cat([normed, rotate_interleaved(rope_key, cos, sin)], dim=-1)


def expanded_attention(std: MLAAttention, x: torch.Tensor, cache: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, shape: MLAShape) -> torch.Tensor:
    """The reference: per-head keys and values rebuilt from the latent cache with kv_b_proj, then SDPA.

    This is transformers' DeepseekV3Attention path (its cache holds the same rows); x [B, S, H] → [B, S, H].
    """
    B, S, _ = x.shape
    T = cache.shape[1]
    N, r, R, P, V = shape.heads, shape.rank, shape.rope_dim, shape.nope_dim, shape.v_dim
    q = F.linear(x, std.q_proj).view(B, S, N, P + R).transpose(1, 2)  # [B, N, S, P+R]
    query = torch.cat([q[..., :P], rotate_interleaved(q[..., P:], cos, sin)], dim=-1)
    kv = F.linear(cache[..., :r], std.kv_b_proj).view(B, T, N, P + V).transpose(1, 2)  # [B, N, T, P+V]
    shared_rope_key = cache[:, None, :, r:].expand(B, N, T, R)
    keys = torch.cat([kv[..., :P], shared_rope_key], dim=-1)  # [B, N, T, P+R]
    out = F.scaled_dot_product_attention(query, keys, kv[..., P:], attn_mask=causal_mask(S, T, x.device),
                                         scale=shape.softmax_scale)  # [B, N, S, V]
    return F.linear(out.transpose(1, 2).reshape(B, S, N * V), std.o_proj, std.o_bias)
