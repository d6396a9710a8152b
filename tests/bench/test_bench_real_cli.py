"""The real-model benches' command lines, as their docstrings and results write them, parse as meant."""

from __future__ import annotations

import json

from bench.real import heal_probe
from helpers import ROOT


def test_a_heal_probe_command_parses_into_name_row_and_healing_options():
    args = heal_probe.parse("lr5e-4 --from unhealed-50 -- --tokens 102400 --written 0 --lr 5e-4".split())
    assert (args.name, args.base) == ("lr5e-4", "unhealed-50")
    assert args.heal_args == ["--tokens", "102400", "--written", "0", "--lr", "5e-4"]
    recorded = json.loads((ROOT / "bench" / "results" / "real-heal-probes.json").read_text(encoding="utf-8"))["rows"]
    for row in recorded:  # every probe's own command line reads back as the probe it recorded
        again = heal_probe.parse(row["command"].split()[3:])
        assert (again.name, again.base, " ".join(again.heal_args)) == (row["name"], row["healed_from"], row["options"])
