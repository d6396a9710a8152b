#!/usr/bin/env python
"""What refinement a CPU user gets for every shipped recipe, by mlaconv's own estimate (issue 16).

For each recipe in ``recipes/`` (shapes checked against its model's config in ``tests/data/configs``, as the tests
do), the refinement plan ``refinement_plan`` would choose on a CPU: the full plan's estimated hours at
``CPU_FLOPS``, and what runs instead when that is over 30 minutes (a reduced plan of N steps of one window, or
none). Beside it, the same estimate for the plan before issue 16's last change (75 steps of 4 windows, the error
at every position, measured every 10 steps; reduced steps of one whole window).

    python -m bench.refine.plans
    python -m bench.refine.plans --result refine-plans     # → bench/results/refine-plans.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

from bench.lib import REPO as ROOT
from bench.lib.results import write_result
from mlaconv.calibration.windows import split_windows
from mlaconv.conversion import calibrated
from mlaconv.conversion.options import load_recipe
from mlaconv.conversion.plan import ShapeChoice, check_recipe
from mlaconv.mla.refine import refinement_flops
from mlaconv.source.spec import SourceSpec

BEFORE = dict(steps=75, batch=4, check_every=10, budget=1800)  # the default plan before the error was taken at a
# share of positions


def before_seconds(spec: SourceSpec, shapes: ShapeChoice, window: int, selected: int, steps: int, batch: int,
                   check_every: int) -> float:
    """The estimate as it was: every step's error at every position."""
    def flops(windows: int) -> float:
        return refinement_flops(spec.attention_shape, shapes.rope_dim, shapes.rank, windows, window)

    checks = 1 + -(-steps // check_every)
    return spec.num_layers * (steps * flops(batch) + checks * flops(selected) / 3) / calibrated.CPU_FLOPS


def before_plan(spec: SourceSpec, shapes: ShapeChoice, window: int, selected: int) -> calibrated.CPURefinement:
    """``calibrated.affordable``'s rule on the estimate as it was."""
    return calibrated.affordable(partial(before_seconds, spec, shapes, window, selected), **BEFORE)


def describe(cpu: calibrated.CPURefinement) -> str:
    if cpu.reduced_steps is None:
        return "full"
    if cpu.reduced_steps:
        return f"{cpu.reduced_steps} steps of 1 window"
    return f"none (25 steps: {cpu.least_seconds / 3600:.1f} h)"


def recipe_plans() -> dict[str, tuple[calibrated.CPURefinement, calibrated.CPURefinement]]:
    """Per recipe name: what a CPU can afford now and before."""
    plans = {}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        recipe = load_recipe(path)
        spec = SourceSpec.from_config(json.loads((ROOT / "tests" / "data" / "configs" / f"{path.stem}.json").read_text()))
        window = recipe.options["calib_window"]
        selected = len(split_windows(recipe.options["calib_tokens"] // window).select)
        shapes = check_recipe(recipe, spec)
        plans[path.stem] = (calibrated.cpu_refinement(spec, shapes, window, selected),
                            before_plan(spec, shapes, window, selected))
    return plans


COLUMNS = [["recipe", "{recipe}"], ["full plan, estimate", "{full_hours:.1f} h"], ["a CPU runs", "{cpu_runs}"],
           ["before: full plan", "{before_full_hours:.1f} h"], ["a CPU ran before", "{before_cpu_runs}"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", metavar="NAME", help="also write bench/results/NAME.json")
    args = parser.parse_args()
    rows = []
    print(f"{'recipe':<18} | {'full plan now':>13} {'a CPU runs now':<26} | {'full before':>11} {'a CPU ran before':<26}")
    for name, (now, before) in recipe_plans().items():
        print(f"{name:<18} | {now.full_seconds / 3600:>11.1f} h {describe(now):<26} | "
              f"{before.full_seconds / 3600:>9.1f} h {describe(before):<26}")
        rows.append({"recipe": name, "full_hours": round(now.full_seconds / 3600, 4), "cpu_runs": describe(now),
                     "before_full_hours": round(before.full_seconds / 3600, 4), "before_cpu_runs": describe(before)})
    if args.result:
        print(write_result(args.result, "refine", rows, COLUMNS, title="The refinement a CPU gets, per shipped recipe",
                           notes=f"An estimate, not a measurement: refinement_plan at CPU_FLOPS = "
                                 f"{calibrated.CPU_FLOPS:.0e}; 'before' is the plan before issue 16's last change "
                                 "(75 steps of 4 windows, every position)."))


if __name__ == "__main__":
    main()
