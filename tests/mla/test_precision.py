"""A layer factored in float32 (``LayerOptions.precision``) against the same layer factored in float64."""

from __future__ import annotations

from dataclasses import replace

import torch

from mlaconv.conversion.plan import factor_precision
from mlaconv.mla import rope
from mlaconv.mla.attention import convert_attention
from mlaconv.mla.forward import mla_attention, rms_norm
from mlaconv.mla.layer import AttentionShape, LayerOptions, SourceAttention
from mlaconv.mla.rope import rope_angles

SHAPE = AttentionShape(hidden=256, heads=8, kv_heads=2, head_dim=32)
OPTIONS = LayerOptions(rank=48, rope_dim=16, rope_theta=10000.0)


def bf16_layer(seed: int) -> SourceAttention:
    g = torch.Generator().manual_seed(seed)
    H, N, G, d = SHAPE.hidden, SHAPE.heads, SHAPE.kv_heads, SHAPE.head_dim
    weights = {name: torch.randn(rows, cols, generator=g) * 0.05
               for name, rows, cols in (("q", N * d, H), ("k", G * d, H), ("v", G * d, H), ("o", H, N * d))}
    return SourceAttention(**weights, input_norm=1 + 0.2 * torch.randn(H, generator=g)).cast(dtype=torch.bfloat16)


def attention_output(layer, stride: int, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The converted layer written in ``dtype``, computed in float64 (plain PyTorch, ``mlaconv.mla.forward``)."""
    layer = layer.cast(dtype=dtype).cast(dtype=torch.float64)
    kept = rope.source_frequencies(OPTIONS.rope_theta, SHAPE.head_dim)[rope.kept_frequencies(OPTIONS.rope_dim, stride)]
    angles = rope_angles(kept, hidden.shape[1])
    return mla_attention(rms_norm(hidden, layer.input_norm, 1e-6), layer, SHAPE, OPTIONS.rank, OPTIONS.rope_dim, angles)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_a_float32_factorization_is_far_under_bfloat16_rounding():
    """The float32 factorization differs from the float64 one by much less than writing either in bfloat16."""
    hidden = torch.randn(2, 64, SHAPE.hidden, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for seed in range(3):
        layer = bf16_layer(seed)
        exact, report = convert_attention(layer, SHAPE, OPTIONS)
        single, single_report = convert_attention(layer, SHAPE, replace(OPTIONS, precision=torch.float32))
        assert single.kv_b_proj.dtype == torch.float32 and exact.kv_b_proj.dtype == torch.float64
        assert single_report.rope_stride == report.rope_stride
        reference = attention_output(exact, report.rope_stride, hidden, torch.float64)
        rounding = relative(attention_output(exact, report.rope_stride, hidden, torch.bfloat16), reference)
        assert rounding > 1e-3
        assert relative(attention_output(single, report.rope_stride, hidden, torch.float32), reference) < 0.01 * rounding


def test_only_16_bit_outputs_are_factored_in_float32():
    assert factor_precision(torch.bfloat16) == torch.float32
    assert factor_precision(torch.float16) == torch.float32
    assert factor_precision(torch.float32) == torch.float64
    assert factor_precision(None) == torch.float64
