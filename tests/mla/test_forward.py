"""``mlaconv.mla.forward.causal_attention`` against causal softmax attention written out here."""

from __future__ import annotations

import math

import torch

from mlaconv.mla.forward import causal_attention


def by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    S = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), -torch.inf)
    return torch.softmax(scores, -1) @ v


def test_values_narrower_than_the_queries_attend_as_written_out():
    """MLA's shape (values d wide, queries and keys d + R): the padded values change nothing, and the output is
    as wide as the values; equal widths too."""
    g = torch.Generator().manual_seed(0)
    for value_width in (8, 24):
        q, k, v = (torch.randn(2, 3, 40, width, generator=g, dtype=torch.float64) for width in (24, 24, value_width))
        out = causal_attention(q, k, v)
        assert out.shape == v.shape
        assert torch.allclose(out, by_hand(q, k, v), atol=1e-12, rtol=0)
