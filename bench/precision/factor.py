#!/usr/bin/env python
"""One weights-only layer of a given shape factored in float64 and in float32 (issue 16): CPU seconds of each, and
how far apart their attention outputs are next to what writing the layer in bfloat16 changes.

    OMP_NUM_THREADS=1 python -m bench.precision.factor                    # Llama-3.2-1B's layer shape
    OMP_NUM_THREADS=1 python -m bench.precision.factor 8192,64,8,128 448,64  # HIDDEN,HEADS,KV_HEADS,HEAD_DIM RANK,ROPE_DIM

A random bfloat16 layer (weights ~ N(0, 0.02²), input norm 1 ± 0.1); the attention outputs are computed in float64
by ``mlaconv.mla.forward.mla_attention`` on 2 × 256 random hidden states.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from mlaconv.mla import rope
from mlaconv.mla.attention import convert_attention
from mlaconv.mla.forward import mla_attention, rms_norm
from mlaconv.mla.layer import AttentionShape, LayerOptions, SourceAttention
from mlaconv.mla.rope import rope_angles

THETA = 500000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", nargs="?", default="2048,32,8,64")
    parser.add_argument("ranks", nargs="?", default="512,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    H, N, G, d = map(int, args.shape.split(","))
    r, R = map(int, args.ranks.split(","))
    shape, options = AttentionShape(H, N, G, d), LayerOptions(rank=r, rope_dim=R, rope_theta=THETA)
    g = torch.Generator().manual_seed(0)
    src = SourceAttention(q=torch.randn(N * d, H, generator=g) * 0.02, k=torch.randn(G * d, H, generator=g) * 0.02,
                          v=torch.randn(G * d, H, generator=g) * 0.02, o=torch.randn(H, N * d, generator=g) * 0.02,
                          input_norm=1 + 0.1 * torch.randn(H, generator=g)).cast(dtype=torch.bfloat16)
    hidden = torch.randn(2, 256, H, generator=g, dtype=torch.float64)

    def output(layer, stride: int, dtype: torch.dtype) -> torch.Tensor:
        layer = layer.cast(dtype=dtype).cast(dtype=torch.float64)
        kept = rope.source_frequencies(THETA, d)[rope.kept_frequencies(R, stride)]
        return mla_attention(rms_norm(hidden, layer.input_norm, 1e-6), layer, shape, r, R, rope_angles(kept, 256))

    results = {}
    for precision in (torch.float64, torch.float32):
        layer_options = replace(options, precision=precision)
        convert_attention(src, shape, layer_options)  # warm-up
        seconds = []
        for _ in range(args.repeats):
            started = time.process_time()
            results[precision] = convert_attention(src, shape, layer_options)
            seconds.append(time.process_time() - started)
        print(f"{str(precision):14s} CPU s a layer: {min(seconds):.3f} (trials {', '.join(f'{s:.3f}' for s in seconds)})")
    (exact, report), (single, _) = results[torch.float64], results[torch.float32]
    reference = output(exact, report.rope_stride, torch.float64)

    def relative(y: torch.Tensor) -> float:
        return ((y - reference).norm() / reference.norm()).item()

    print(f"attention output vs the float64 factorization (relative): float32 factorization "
          f"{relative(output(single, report.rope_stride, torch.float32)):.2e}; the float64 one written in bfloat16 "
          f"{relative(output(exact, report.rope_stride, torch.bfloat16)):.2e}")


if __name__ == "__main__":
    main()
