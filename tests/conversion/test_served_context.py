"""The --kv-keep split search holds to the context the output will serve: a split whose folded rotary frequencies
turn by more than FOLD_TURN over it is left out, the report says which and why, and where no split of the budget
passes, the least-turning one is kept and the report says so."""

from __future__ import annotations

import pytest

from helpers import random_tokens, write_tokens
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.plan import FOLD_TURN
from mlaconv.conversion.run import convert
from mlaconv.errors import MlaconvError


@pytest.fixture
def setup(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=32, hidden=128, heads=4)  # 16 frequencies, θ = 10⁴, 256 positions
    calib = write_tokens(tmp_path / "calib.jsonl", random_tokens(8, 48, 96, seed=8))
    return src, dict(kv_keep=0.5, verify=False, calib_window=48, heal_tokens=0, refine_steps=0, calib=[str(calib)])


def turn(index: int, context: int) -> float:
    return 1e4 ** (-2 * index / 32) * context


def test_splits_that_fold_turning_frequencies_over_the_served_context_are_left_out(setup, tmp_path):
    src, options = setup
    # the model's own 256 positions: ω_11·256 = 0.41 turns, ω_12·256 = 0.26 does not → R ≥ 24, so 32 alone is kept;
    # R = 16 folds ω_8 and slower
    assert turn(11, 256) > FOLD_TURN >= turn(12, 256)
    report = convert(str(src), tmp_path / "served", ConvertOptions(**options))
    served = report.shape_search
    assert served.context == 256 and served.candidates == [] and report.qk_rope_head_dim == 32
    assert f"left out, as their folded frequencies turn by more than {FOLD_TURN} rad over it: R = 16 " \
           f"({turn(8, 256):.2f} rad)" in served.chosen
    # 16 positions: ω_8·16 = 0.16, so every split passes
    short = convert(str(src), tmp_path / "short", ConvertOptions(**options, context=16)).shape_search
    assert short.context == 16 and sorted(c.qk_rope_head_dim for c in short.candidates) == [16, 32]
    assert "left out" not in short.chosen


def test_where_no_split_of_the_budget_passes_the_least_turning_is_kept_and_said(setup, tmp_path):
    src, options = setup
    report = convert(str(src), tmp_path / "deep", ConvertOptions(**dict(options, kv_keep=0.25)))  # R ≤ 16
    assert report.qk_rope_head_dim == 16 and report.shape_search.candidates == []
    assert (f"no split of this budget keeps every frequency that turns more than {FOLD_TURN} rad over it: this one "
            f"folds frequencies turning {turn(8, 256):.2f} rad") in report.shape_choice
    with pytest.raises(MlaconvError, match="--context must be positive"):
        convert(str(src), tmp_path / "bad", ConvertOptions(**options, context=0))
    assert not (tmp_path / "bad").exists()
