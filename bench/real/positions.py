"""Drift by position in long windows of a model against the real source (issue 32), into
bench/results/real-positions-NAME.json.

``mlaconv.evaluate_perplexity`` with position buckets: the figures over tokens [0, 512), [512, 2048) and
[2048, window) of each window. The result holds the commit, the machine, the load, the command and the report.

    python -m bench.real.positions bench/_work/real/defaults-50 --name defaults-50 --text WIKITEXT
    python -m bench.real.positions bench/_work/real/defaults-50 --name dev-defaults-50 \\
        --text bench/real/data/pride_and_prejudice.txt          # a development text: choose here
"""

from __future__ import annotations

import os

# Before torch loads OpenMP, as the mlaconv command sets it: waiting threads sleep instead of spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.lib.results import commit, load_span, machine, write_json  # noqa: E402
from bench.real.build import DEFAULT_OUT as SOURCE  # noqa: E402
from mlaconv.evaluate.perplexity import evaluate_perplexity  # noqa: E402
from mlaconv.io.text import TokenSource  # noqa: E402
from mlaconv.progress import LineProgress  # noqa: E402

BUCKETS = (512, 2048)
WINDOW = 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="the model to measure (a converted folder)")
    parser.add_argument("--source", type=Path, default=SOURCE, help="the baseline (default: the built SmolLM2-135M)")
    parser.add_argument("--name", required=True, help="the result is bench/results/real-positions-NAME.json")
    parser.add_argument("--text", type=Path, required=True, help="the text whose windows are measured")
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--max-windows", type=int, default=8)
    parser.add_argument("--buckets", default=",".join(map(str, BUCKETS)),
                        help="where the position buckets start after 0 (default 512,2048)")
    parser.add_argument("--title", default=None, help="one line on what was measured (default: from the arguments)")
    args = parser.parse_args()

    report = evaluate_perplexity(args.model, args.source, source=TokenSource(text=args.text), window=args.window,
                                 max_windows=args.max_windows,
                                 position_buckets=tuple(int(start) for start in args.buckets.split(",")),
                                 progress=LineProgress(sys.stderr))
    for bucket in report.by_position:
        print(f"tokens {bucket.start:>5}–{bucket.end:<5} drift {bucket.drift:+.1%} ± {bucket.drift_stderr:.1%}, "
              f"KL {bucket.kl:.3f}, top-1 {bucket.top1:.1%}", flush=True)
    title = args.title or (f"SmolLM2-135M ({args.model.name}): drift by position in {args.window:,}-token windows "
                           f"of {args.text.name}")
    result = {"bench": "real", "title": title, "commit": commit(), "machine": machine(),
              "load": load_span(),
              "command": " ".join(["python -m bench.real.positions", *sys.argv[1:]]), "report": report.to_json()}
    print(write_json(f"real-positions-{args.name}", result))


if __name__ == "__main__":
    main()
