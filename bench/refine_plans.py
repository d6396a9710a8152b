#!/usr/bin/env python
"""What refinement a CPU user gets for every shipped recipe, by mlaconv's own estimate (issue 16).

For each recipe in ``recipes/`` (shapes checked against its model's config in ``tests/data/configs``, as the tests
do), the refinement plan ``refinement_plan`` would choose on a CPU: the full plan's estimated hours at
``CPU_FLOPS``, and what runs instead when that is over 30 minutes (a reduced plan of N steps of one window, or
none). Beside it, the same estimate for the plan before issue 16's last change (75 steps of 4 windows, the error
at every position, measured every 10 steps; reduced steps of one whole window).

    python bench/refine_plans.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from mlaconv import calibrated  # noqa: E402
from mlaconv.arch import SourceSpec  # noqa: E402
from mlaconv.calibrate import split_windows  # noqa: E402
from mlaconv.mla.refine import refinement_flops  # noqa: E402
from mlaconv.options import load_recipe  # noqa: E402
from mlaconv.plan import Plan, check_recipe  # noqa: E402

BEFORE = dict(steps=75, batch=4, check_every=10)  # the default plan before the error was taken at a share of positions


def before_seconds(plan: Plan, window: int, selected: int, steps: int, batch: int, check_every: int) -> float:
    """The estimate as it was: every step's error at every position."""
    def flops(windows: int) -> float:
        return refinement_flops(plan.shape, plan.shapes.rope_dim, plan.shapes.rank, windows, window)

    checks = 1 + -(-steps // check_every)
    return plan.spec.num_layers * (steps * flops(batch) + checks * flops(selected) / 3) / calibrated.CPU_FLOPS


def before_plan(plan: Plan, window: int, selected: int) -> tuple[float, int | None, float]:
    """``calibrated.cpu_refinement``'s rule on the estimate as it was: (full hours, reduced steps, fewest hours)."""
    def seconds(steps, batch, check_every):
        return before_seconds(plan, window, selected, steps, batch, check_every)

    full = seconds(BEFORE["steps"], BEFORE["batch"], BEFORE["check_every"])
    least = seconds(calibrated.MIN_REDUCED_STEPS, 1, calibrated.MIN_REDUCED_STEPS)
    if full <= calibrated.AUTO_REFINE_SECONDS:
        return full / 3600, None, least / 3600
    fits = [n for n in range(calibrated.MIN_REDUCED_STEPS, BEFORE["steps"] * BEFORE["batch"] + 1)
            if seconds(n, 1, n) <= calibrated.AUTO_REFINE_SECONDS]
    return full / 3600, fits[-1] if fits else 0, least / 3600


def describe(steps: int | None, least: float) -> str:
    return "full" if steps is None else f"{steps} steps of 1 window" if steps else f"none (25 steps: {least:.1f} h)"


def recipe_plans() -> dict[str, tuple[tuple[float, int | None, float], tuple[float, int | None, float]]]:
    """Per recipe name: ``cpu_plan`` now and before."""
    plans = {}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        recipe = load_recipe(path)
        spec = SourceSpec.from_config(json.loads((ROOT / "tests" / "data" / "configs" / f"{path.stem}.json").read_text()))
        shapes = check_recipe(recipe, spec)
        window = recipe.options["calib_window"]
        selected = len(split_windows(recipe.options["calib_tokens"] // window).select)
        plan = Plan(folder=path, spec=spec, reader=None, shapes=shapes, layer=None)

        now = calibrated.cpu_refinement(plan, window, selected)
        plans[path.stem] = ((now.full_seconds / 3600, now.reduced_steps, now.least_seconds / 3600),
                            before_plan(plan, window, selected))
    return plans


def main() -> None:
    print(f"{'recipe':<18} | {'full plan now':>13} {'a CPU runs now':<26} | {'full before':>11} {'a CPU ran before':<26}")
    for name, ((hours, steps, least), (old_hours, old_steps, old_least)) in recipe_plans().items():
        print(f"{name:<18} | {hours:>11.1f} h {describe(steps, least):<26} | {old_hours:>9.1f} h "
              f"{describe(old_steps, old_least):<26}")


if __name__ == "__main__":
    main()
