#!/usr/bin/env python
"""What one refinement step costs on a layer of a given shape, against the plan's estimate (issue 16).

Times ``mlaconv.mla.refine.refine`` on random factors and inputs of the shape of one layer (default: Llama-3.2-1B
at --kv-keep 0.5, r = 448, R = 64, windows of 2048 as the CLI calibrates by default, 8 windows a step, the error
at an eighth of each window's positions, as the default plan runs it) and prints the wall and CPU seconds per step
next to ``refinement_flops / CPU_FLOPS``, the estimate ``refinement_plan`` uses.

    python -m bench.refine.step_cost                      # Llama-3.2-1B-shaped layer, the default plan's step
    python -m bench.refine.step_cost --batch 1            # … the reduced CPU plan's step
    python -m bench.refine.step_cost --batch 4 --queries 0   # … the step before issue 16 (every position)
"""

from __future__ import annotations

import argparse
import time

import torch

from mlaconv.conversion.calibrated import CPU_FLOPS, step_queries
from mlaconv.mla.layer import AttentionShape, LatentAttention
from mlaconv.mla.refine import REFINE_BATCH, refine, refinement_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rank", type=int, default=448)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=REFINE_BATCH)
    parser.add_argument("--queries", type=int, default=None,
                        help="positions a window a step's error is taken at (default: the plan's eighth; 0: all)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    H, N, G, d, r, R = args.hidden, args.heads, args.kv_heads, args.head_dim, args.rank, args.rope_dim
    shape = AttentionShape(hidden=H, heads=N, kv_heads=G, head_dim=d)
    g = torch.Generator().manual_seed(0)

    def w(*size):
        return torch.randn(*size, generator=g, dtype=torch.float64) / size[-1] ** 0.5

    latent = LatentAttention(q_nope=w(N * d, H), q_rope=w(N * R, H), down=w(r, H), k_rope=w(R, H),
                             up_k=w(G * d, r), up_v=w(G * d, r), o=w(H, N * d))
    x = torch.randn(args.batch, args.window, H, generator=g)
    y = torch.randn(args.batch, args.window, H, generator=g)
    slots = 1e4 ** (-torch.arange(R // 2, dtype=torch.float64) / (R // 2))
    queries = step_queries(args.window) if args.queries is None else (args.queries or None)
    one = (x[:1], y[:1])
    timings = {}
    for steps in (args.steps, args.steps, 2 * args.steps):  # the first run warms up; the difference of the
        # other two is args.steps steps, with the same two select-window measurements (before and after) in each
        wall, cpu = time.perf_counter(), time.process_time()
        refine(latent, shape, R, slots, (x, y), one, steps=steps, batch=args.batch, check_every=steps,
               queries=queries)
        timings[steps] = (time.perf_counter() - wall, time.process_time() - cpu)
    wall = (timings[2 * args.steps][0] - timings[args.steps][0]) / args.steps
    cpu = (timings[2 * args.steps][1] - timings[args.steps][1]) / args.steps
    estimate = refinement_flops(shape, R, r, args.batch, args.window, queries) / CPU_FLOPS
    print(f"layer H={H} N={N} G={G} d={d} r={r} R={R}, {args.batch}×{args.window} tokens a step, error at "
          f"{queries or args.window} positions a window, "
          f"{torch.get_num_threads()} threads")
    print(f"  per step: wall {wall:.3g} s, CPU {cpu:.3g} s; estimate at CPU_FLOPS={CPU_FLOPS:.0e}: {estimate:.3g} s")


if __name__ == "__main__":
    main()
