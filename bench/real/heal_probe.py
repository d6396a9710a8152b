"""Screen a healing option on SmolLM2-135M before a full row: a short healing run scored on the development texts only.

A full row (``bench.real.fidelity --heal-from``) heals for the default budget and scores the report texts: over an
hour here. A probe heals an earlier row's folder for a few steps (``--tokens``, usually without written text) with
the options after ``--``, records the development texts' KL at every check (``dev_curve``, the same measurement as
a row's) and healing's own select and held-out figures, with ``--passkey LENGTH`` the healed model's passkey
retrieval at that length (10 trials, seed 0: the prompts every retrieval result of this bench uses; the source's
own answers are in ``retrieval-smollm2-135m-source.json``; ``--passkey-trials 20 --passkey-seed 1``: fresh prompts,
to confirm what seed 0 suggested), and keeps nothing else: the healed folder goes to a
temporary directory and no report text is read. Probes of one option against another are compared at equal steps;
what they show decides which full row is worth running. Rows in ``bench/results/real-heal-probes.json`` (keyed by
name; a rerun replaces its row).

    python -m bench.real.heal_probe lr1e-3 --from unhealed-50 -- --tokens 102400 --written 0 --lr 1e-3
    python -m bench.real.heal_probe window-2048 --from unhealed-50 --passkey 4k -- --tokens 102400 --written 0 --window 2048 --batch 1
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the mlaconv command sets it, before torch loads

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.lib import RESULTS, WORK  # noqa: E402
from bench.lib.results import commit, read_result, write_result  # noqa: E402
from bench.real.dev import TEXTS  # noqa: E402
from bench.real.build import DEFAULT_OUT as SOURCE  # noqa: E402
from bench.real.fidelity import run_heal  # noqa: E402
from bench.real.positions import BUCKETS, WINDOW as POSITION_WINDOW  # noqa: E402
from mlaconv.evaluate.perplexity import evaluate_perplexity  # noqa: E402
from mlaconv.evaluate.retrieval import evaluate_retrieval  # noqa: E402
from mlaconv.io.text import TokenSource, token_counts  # noqa: E402
from mlaconv.progress import LineProgress  # noqa: E402

NAME = "real-heal-probes"
COLUMNS = [["probe", "{name}"], ["healed from", "{healed_from}"], ["options", "{options}"],
           ["dev mean KL by check", "{curve_text}"], ["P&P / Python ref / tz at the end", "{end_text}"],
           ["select KL (best step)", "{select_before:.4f} → {select_after:.4f} ({best_step})"],
           ["held-out KL", "{held_before:.3f} → {held_after:.3f}"], ["passkey", "{passkey_text}"],
           ["P&P drift by position", "{positions_text}"],
           ["min", "{minutes:.0f}"]]
NOTES = ("The development texts' sparse KL (4 windows of 1,024 of each, the source's top-64) at each check of a short "
         "healing run, `step: mean`; select and held-out: healing's own windows of the bundled general text. "
         "passkey: right answers at that length, and by fifth of the needle's depth (the source: 10/10 at 4K, 2/2 in each "
         "fifth). P&P drift by position: the healed model's drift over tokens 0–512 / 512–2K / 2K–4K of 8 windows of 4,096 of "
         "*Pride and Prejudice* (`--positions`). Nothing here reads WikiText-2 or *Moby Dick*.")


def probe(name: str, base: str, args: list[str], passkey: int | None = None, trials: int = 10, seed: int = 0,
          positions: bool = False) -> dict:
    folder = WORK / "real" / base
    if not (folder / "config.json").is_file():
        raise SystemExit(f"no converted folder {folder}: run python -m bench.real.fidelity --name {base} first")
    with tempfile.TemporaryDirectory() as scratch:
        healed = Path(scratch) / "healed"
        report, wall, _, curve = run_heal(healed, folder, args)
        retrieval = None if passkey is None else evaluate_retrieval(
            healed, lengths=[passkey], trials=trials, seed=seed, progress=LineProgress(sys.stderr, 60)).lengths[0].to_json()
        by_position = None if not positions else [bucket.to_json() for bucket in evaluate_perplexity(
            healed, SOURCE, source=TokenSource(text=TEXTS["pride_and_prejudice"]), window=POSITION_WINDOW, max_windows=8,
            position_buckets=BUCKETS, progress=LineProgress(sys.stderr, 60)).by_position]
    return probe_row(name, base, args, report["heal"], wall, curve, retrieval, seed, by_position)


def passkey_text(retrieval: dict) -> str:
    """``7/10 at 4096 (1/2 1/2 1/2 2/2 2/2)``: right answers, then by fifth of depth."""
    right = round(retrieval["accuracy"] * len(retrieval["cases"]))
    fifths = " ".join(f"{round(b['accuracy'] * b['trials'])}/{b['trials']}" for b in retrieval["by_depth"])
    return f"{right}/{len(retrieval['cases'])} at {retrieval['length']} ({fifths})"


def probe_row(name: str, base: str, args: list[str], heal: dict, wall: float, curve: list[dict],
              retrieval: dict | None = None, seed: int = 0, by_position: list[dict] | None = None) -> dict:
    """A probe's row from its healing report (``mlaconv.json``'s ``heal``), wall seconds, development curve,
    passkey retrieval (``RetrievalLength``'s JSON, or None) on the prompts of ``seed`` and drift by position (the
    buckets' JSON, or None)."""
    positions = {} if by_position is None else {
        "positions": by_position, "positions_text": " / ".join(f"{b['drift']:+.1%}" for b in by_position)}
    means = [sum(point[text] for text in TEXTS) / len(TEXTS) for point in curve]
    passkey = {} if retrieval is None else {
        "passkey": retrieval, "passkey_seed": seed,
        "passkey_text": passkey_text(retrieval) + (f", seed {seed}" if seed else "")}
    flags = ("" if retrieval is None else (
        f"--passkey {retrieval['length']} " + (f"--passkey-trials {len(retrieval['cases'])} "
                                               if len(retrieval["cases"]) != 10 else "")
        + (f"--passkey-seed {seed} " if seed else ""))) + ("--positions " if by_position is not None else "")
    return passkey | positions | {"name": name, "healed_from": base, "options": " ".join(args), "steps": heal["steps"],
            "dev_curve": curve, "curve_text": ", ".join(f"{p['step']}: {m:.4f}" for p, m in zip(curve, means)),
            "end_text": " / ".join(f"{curve[-1][text]:.4f}" for text in TEXTS),
            "select_before": heal["select_kl_before"], "select_after": heal["select_kl_after"],
            "best_step": heal["best_step"], "held_before": heal["held_out_before"]["kl"],
            "held_after": heal["held_out_after"]["kl"], "minutes": wall / 60, "commit": commit(),
            "load": os.getloadavg(),
            "command": f"python -m bench.real.heal_probe {name} --from {base} {flags}-- " + " ".join(args)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the probe's name (a rerun replaces it)")
    parser.add_argument("--from", dest="base", required=True, help="the fidelity row whose folder is healed")
    parser.add_argument("--passkey", type=lambda text: token_counts(text, "--passkey")[0], default=None,
                        help="also measure the healed model's passkey retrieval at this length (e.g. 4k)")
    parser.add_argument("--passkey-trials", type=int, default=10, help="passkey prompts (default 10)")
    parser.add_argument("--passkey-seed", type=int, default=0, help="their seed (default 0, the bench's usual prompts)")
    parser.add_argument("--positions", action="store_true", help="also measure the healed model's drift by position "
                        "in 4,096-token windows of the development novel")
    parser.add_argument("heal_args", nargs="*", help="after --: mlaconv heal's training options")
    return parser.parse_intermixed_args(argv)  # NAME --from ROW -- OPTIONS: the options after the name's flag


def main() -> None:
    args = parse()
    rows = read_result(NAME)["rows"] if (RESULTS / f"{NAME}.json").is_file() else []
    row = probe(args.name, args.base, args.heal_args, args.passkey, args.passkey_trials, args.passkey_seed,
                args.positions)
    write_result(NAME, "real", [r for r in rows if r["name"] != args.name] + [row], COLUMNS, NOTES,
                 title="Short healing runs of SmolLM2-135M at 50%, scored on the development texts (probes)")
    print(row["name"], row["curve_text"])


if __name__ == "__main__":
    main()
