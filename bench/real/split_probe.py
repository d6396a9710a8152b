"""Which (r, R) split of a --kv-keep budget is best once refined, and how few refinement steps tell.

In closed form the splits rank by the key side, which the refinement then repairs far more than the values
(``loss_by_component``); this probe is what showed it, and why ``mlaconv convert --kv-keep`` compares its splits
after ``SEARCH_REFINE_STEPS`` reduced-plan steps. It converts sampled layers of a source at every candidate split
the way the conversion does (the calibrated, attention-weighted closed form on the bundled text's fit windows),
refines each with the reduced CPU plan's steps (one window, an eighth of its positions, 3e-3) and records the mean
relative attention error on the select windows in closed form and after each checkpoint's steps
(``calibrated.split_errors``, the search's own measurement). The rows go to ``bench/results/real-split-probe.json``
(a rerun of a name replaces its rows).

    python -m bench.real.split_probe --name smollm2-50 --kv-keep 0.5 --rope-dims 16,32,48,64
"""

from __future__ import annotations

import os

# Before torch loads OpenMP, as the mlaconv command sets it: waiting threads sleep instead of spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.lib.results import RESULTS, commit, write_result  # noqa: E402
from bench.real.build import DEFAULT_OUT as SOURCE  # noqa: E402
from mlaconv.conversion.calibrated import (calibrated_layer_options, calibration_streamer,  # noqa: E402
                                           calibration_tokens, split_errors, training_windows)
from mlaconv.conversion.options import ConvertOptions  # noqa: E402
from mlaconv.conversion.pipeline import source_layers  # noqa: E402
from mlaconv.conversion.plan import kv_budget, plan_conversion, rope_strides  # noqa: E402
from mlaconv.progress import LineProgress  # noqa: E402


def latent_variant(name: str) -> dict:
    """``WEIGHTING[:VALUE_WEIGHT]`` (e.g. ``attention``, ``balanced:4``) → the layer options' latent weighting."""
    weighting, _, value_weight = name.partition(":")
    return {"latent_weighting": weighting, "value_weight": float(value_weight or 1)}


def probe(source: Path, kv_keep: float, rope_dims: list[int], variants: list[str], layers: list[int],
          checkpoints: list[int]) -> list[dict]:
    """One row per candidate (R, latent variant): its rank and the mean select error over ``layers`` after each
    checkpoint's steps."""
    plan = plan_conversion(str(source), ConvertOptions(kv_keep=kv_keep, heal_tokens=0))
    _, budget = kv_budget(plan.spec, kv_keep, None, plan.target)
    tokens = calibration_tokens(plan)
    progress = LineProgress(sys.stderr)
    strides = rope_strides(plan, rope_dims, progress)
    options = {(R, v): replace(calibrated_layer_options(plan.layer), rank=budget - R - (budget - R) % 16, rope_dim=R,
                               rope_stride=strides[R], **latent_variant(v)) for R in rope_dims for v in variants}
    streamer = calibration_streamer(plan, tokens)
    window = tokens.shape[1]
    train_windows = training_windows(len(streamer.split.fit), window, plan.options.refine_tokens)
    errors = {key: [[] for _ in (0, *checkpoints)] for key in options}
    for source_layer in source_layers(plan.reader, plan.spec, streamer, progress, "probing splits"):
        i, src = source_layer.index, source_layer.attention
        if i not in layers:
            continue
        train, select = streamer.refinement_data(i, src, train_windows)
        for (R, v), layer in options.items():
            for k, error in enumerate(split_errors(plan, streamer, source_layer, layer, window, train, select,
                                                   tuple(checkpoints))):
                errors[R, v][k].append(error)
            print(f"layer {i} R {R} {v}: " + " ".join(f"{e[-1]:.4f}" for e in errors[R, v]), flush=True)
    return [{"rank": layer.rank, "rope_dim": R, "variant": v, "budget": budget,
             "error": {f"{steps} steps": sum(e) / len(e) for steps, e in zip((0, *checkpoints), errors[R, v])}}
            for (R, v), layer in options.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--kv-keep", type=float, required=True)
    parser.add_argument("--rope-dims", default="16,32,48,64")
    parser.add_argument("--variants", default="attention",
                        help="latent weightings, WEIGHTING[:VALUE_WEIGHT] each (balanced, attention; e.g. balanced:4)")
    parser.add_argument("--layers", default="1,4,7,10,13,16,19,22,25,28")
    parser.add_argument("--checkpoints", default="25,50,100,200")
    parser.add_argument("--source", type=Path, default=SOURCE)
    args = parser.parse_args()
    checkpoints = [int(s) for s in args.checkpoints.split(",")]
    layers = [int(s) for s in args.layers.split(",")]
    start = time.monotonic()
    rows = probe(args.source, args.kv_keep, [int(s) for s in args.rope_dims.split(",")], args.variants.split(","),
                 layers, checkpoints)
    command = " ".join(["python -m bench.real.split_probe", *sys.argv[1:]])
    minutes = (time.monotonic() - start) / 60
    for row in rows:
        row.update(run=args.name, layers=layers, minutes=minutes, commit=commit(), command=command)
    path = RESULTS / "real-split-probe.json"
    kept = [r for r in json.loads(path.read_text())["rows"] if r["run"] != args.name] if path.exists() else []
    measured = sorted({int(key.split()[0]) for row in kept + rows for key in row["error"]})  # every run's checkpoints
    columns = [["run", "{run}"], ["r + R", "{rank} + {rope_dim}"], ["latent", "{variant}"],
               *[[f"after {s} steps" if s else "closed form", f"{{error[{s} steps]:.4f}}"] for s in measured]]
    print(write_result("real-split-probe", "real", kept + rows, columns, title=(
        "SmolLM2-135M: mean relative attention error on the select windows of each (r, R) split, closed form and "
        "after the reduced refinement's steps (sampled layers)")))


if __name__ == "__main__":
    main()
