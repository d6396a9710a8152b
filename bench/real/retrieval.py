"""Passkey retrieval of a model against the real source (issue 32), into bench/results/retrieval-NAME.json.

``mlaconv.evaluate_retrieval`` at each length; the result holds the commit, the machine, the command and the rows.

    python -m bench.real.build                                             # the source, once
    python -m bench.real.retrieval out/smollm2-mla --name smollm2-kv50      # a converted model against it
    python -m bench.real.retrieval bench/_work/models/smollm2-135m --name source --lengths 1k,2k,4k   # itself

Each length is its own ``evaluate_retrieval`` call (the models load again, a second or two), so each row has
its seconds. A row is that length's report entry (docs/report.md, "retrieval.lengths[]") and its seconds.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP, as the mlaconv command sets it: waiting threads sleep instead of spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.lib.results import commit, machine, write_json  # noqa: E402
from bench.real.build import DEFAULT_OUT as SOURCE  # noqa: E402
from mlaconv.evaluate.retrieval import evaluate_retrieval  # noqa: E402
from mlaconv.io.text import token_counts  # noqa: E402
from mlaconv.progress import LineProgress  # noqa: E402



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="the model to measure (a converted folder, or the source itself)")
    parser.add_argument("--source", type=Path, default=SOURCE, help="the baseline (default: the built SmolLM2-135M)")
    parser.add_argument("--name", required=True, help="the result is bench/results/retrieval-NAME.json")
    parser.add_argument("--lengths", default="1k,2k,4k")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()

    rows = []
    for length in token_counts(args.lengths, "--lengths"):
        report = evaluate_retrieval(args.model, args.source, lengths=[length], trials=args.trials, seed=args.seed,
                                    dtype=args.dtype, device=args.device, progress=LineProgress(sys.stderr))
        rows.append(report.lengths[0].to_json() | {"seconds": report.seconds})
        print(f"{length:>6} tokens: source {report.baseline_accuracy:.0%}, model {report.accuracy:.0%} "
              f"({report.seconds:.0f} s)", flush=True)
    result = {"commit": commit(), "machine": machine(args.device),
              "command": " ".join(["python -m bench.real.retrieval", *sys.argv[1:]]),
              "model": str(args.model), "source": str(args.source), "trials": args.trials, "seed": args.seed,
              "dtype": args.dtype, "rows": rows}
    print(write_json(f"retrieval-{args.name}", result))


if __name__ == "__main__":
    main()
