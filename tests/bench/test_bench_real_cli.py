"""The real-model benches' command lines, as their docstrings and results write them, parse as meant."""

from __future__ import annotations

import json

from bench.real import heal_probe
from helpers import ROOT


def test_a_heal_probe_command_parses_into_name_row_and_healing_options():
    args = heal_probe.parse("lr5e-4 --from unhealed-50 -- --tokens 102400 --written 0 --lr 5e-4".split())
    assert (args.name, args.base) == ("lr5e-4", "unhealed-50")
    assert args.heal_args == ["--tokens", "102400", "--written", "0", "--lr", "5e-4"]
    assert args.passkey is None
    args = heal_probe.parse("w2k --from unhealed-50 --passkey 4k -- --window 2048 --batch 1".split())
    assert (args.name, args.base, args.passkey, args.heal_args) == ("w2k", "unhealed-50", 4096,
                                                                    ["--window", "2048", "--batch", "1"])
    recorded = json.loads((ROOT / "bench" / "results" / "real-heal-probes.json").read_text(encoding="utf-8"))["rows"]
    for row in recorded:  # every probe's own command line reads back as the probe it recorded
        again = heal_probe.parse(row["command"].split()[3:])
        assert (again.name, again.base, " ".join(again.heal_args)) == (row["name"], row["healed_from"], row["options"])
        assert again.passkey == (row["passkey"]["length"] if "passkey" in row else None)
        if "passkey" in row:
            trials, seed = len(row["passkey"]["cases"]), row.get("passkey_seed", 0)
            assert (again.passkey_trials, again.passkey_seed) == (trials, seed)


def test_a_probe_row_states_its_passkey_answers_in_all_and_by_fifth_of_depth():
    buckets = [{"start": k / 5, "end": (k + 1) / 5, "trials": 2, "accuracy": a} for k, a in
               enumerate([0.0, 0.5, 1.0, 1.0, 1.0])]
    retrieval = {"length": 4096, "accuracy": 0.7, "by_depth": buckets, "cases": [{}] * 10}
    assert heal_probe.passkey_text(retrieval) == "7/10 at 4096 (0/2 1/2 2/2 2/2 2/2)"
    heal = {"steps": 2, "select_kl_before": 0.2, "select_kl_after": 0.1, "best_step": 2,
            "held_out_before": {"kl": 0.3}, "held_out_after": {"kl": 0.2}}
    curve = [{"step": 0, **{text: 0.1 for text in heal_probe.TEXTS}}]
    row = heal_probe.probe_row("p", "unhealed-50", ["--tokens", "4096"], heal, 60.0, curve, retrieval)
    assert row["passkey_text"] == "7/10 at 4096 (0/2 1/2 2/2 2/2 2/2)"
    assert row["command"].endswith("p --from unhealed-50 --passkey 4096 -- --tokens 4096")
    assert "passkey" not in heal_probe.probe_row("p", "unhealed-50", [], heal, 60.0, curve)
    fresh = dict(retrieval, cases=[{}] * 20, by_depth=[dict(b, trials=4) for b in buckets])
    row = heal_probe.probe_row("p", "unhealed-50", ["--tokens", "4096"], heal, 60.0, curve, fresh, seed=1)
    assert row["passkey_text"] == "14/20 at 4096 (0/4 2/4 4/4 4/4 4/4), seed 1"
    again = heal_probe.parse(row["command"].split()[3:])
    assert (again.passkey, again.passkey_trials, again.passkey_seed) == (4096, 20, 1)
    buckets = [{"start": 0, "end": 512, "drift": 0.058}, {"start": 512, "end": 2048, "drift": 0.0571},
               {"start": 2048, "end": 4096, "drift": -0.076}]
    row = heal_probe.probe_row("p", "unhealed-50", ["--tokens", "4096"], heal, 60.0, curve, by_position=buckets)
    assert row["positions_text"] == "+5.8% / +5.7% / -7.6%" and "passkey" not in row
    assert heal_probe.parse(row["command"].split()[3:]).positions
