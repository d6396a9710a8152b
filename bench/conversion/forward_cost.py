#!/usr/bin/env python
"""What one forward pass of the source over a calibration set costs (issue 16's yardstick): CPU seconds per token of
transformers' ``AutoModelForCausalLM`` (float32, no cache, ``bench.conversion.profile.source_forward``) on random windows, and
that rate times a calibration set's tokens.

    OMP_NUM_THREADS=1 python -m bench.conversion.forward_cost            # Llama-3.2-1B shape, 2 windows of 2048
    OMP_NUM_THREADS=1 python -m bench.conversion.forward_cost --model DIR --windows 4 --window 2048 --calib-tokens 131072

Without ``--model`` it writes the synthetic Llama-3.2-1B checkpoint of ``bench.conversion.memory`` (random bf16 weights) to
bench/_work/convert_memory, or reuses it there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.conversion.memory import LLAMA_32_1B, make_checkpoint
from bench.conversion.profile import source_forward
from bench.lib import WORK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--calib-tokens", type=int, default=131072, help="default: the Llama-3.2-1B recipe's")
    args = parser.parse_args()
    model = args.model
    if model is None:
        model = WORK / "convert_memory" / "llama-3.2-1b-synthetic"
        if not (model / "config.json").is_file():
            make_checkpoint(model, LLAMA_32_1B, shard_bytes=2**30)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    tokens = torch.randint(0, vocab, (args.windows, args.window), generator=torch.Generator().manual_seed(0))
    wall, cpu = source_forward(model, tokens, 1)
    per_token = cpu / tokens.numel()
    hours = per_token * args.calib_tokens / 3600
    print(f"{model.name}: {args.windows} × {args.window} tokens, {torch.get_num_threads()} threads: {wall:.1f} s wall, "
          f"{cpu:.1f} CPU-s, {1e3 * per_token:.2f} CPU-ms a token")
    print(f"one forward pass over {args.calib_tokens} calibration tokens: {hours:.2f} CPU-hours "
          f"({hours / 2:.2f} h on 2 cores if both were fully used)")


if __name__ == "__main__":
    main()
