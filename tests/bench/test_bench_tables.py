"""The bench's results are data: every README table is rendered from its result file, every result file is whole.

Offline and fast: reads bench/results/*.json and the bench READMEs, runs no bench."""

from __future__ import annotations

import json

import pytest

from helpers import ROOT

from bench.lib import RESULTS  # noqa: E402
from bench.lib.results import MISSING, cell, markdown_table, render  # noqa: E402
from bench.tables import BLOCK, readmes, rendered  # noqa: E402

KEYS = {"bench", "commit", "machine", "load", "command", "columns", "rows", "notes"}
TABLES = sorted(path for path in RESULTS.glob("*.json") if "columns" in json.loads(path.read_text(encoding="utf-8")))


def test_every_readme_table_is_its_result_file_rendered():
    stale = [str(path.relative_to(ROOT)) for path in readmes()
             if rendered(text := path.read_text(encoding="utf-8")) != text]
    assert stale == [], "run: python -m bench.tables"


def test_every_table_block_names_a_result_file_and_every_table_is_shown():
    named = {m.group("name") for path in readmes() for m in BLOCK.finditer(path.read_text(encoding="utf-8"))}
    assert {path.stem for path in TABLES} <= named
    assert all((RESULTS / f"{name}.json").is_file() for name in named)


@pytest.mark.parametrize("path", TABLES, ids=lambda path: path.stem)
def test_a_result_file_is_whole(path):
    result = json.loads(path.read_text(encoding="utf-8"))
    assert KEYS <= set(result)
    assert (ROOT / "bench" / result["bench"]).is_dir()
    assert all(isinstance(result[key], str) and result[key] for key in ("commit", "machine", "load", "command"))
    assert result["rows"] and all(isinstance(row, dict) for row in result["rows"])
    for title, template in result["columns"]:
        cells = [cell(template, row) for row in result["rows"]]
        assert any(c != MISSING for c in cells), f"column {title!r} is empty in every row"
    assert render(result).count("\n|") == len(result["rows"]) + 2  # the header, the rule, a line a row


def test_a_missing_value_renders_as_not_measured_and_pipes_are_escaped():
    table = markdown_table([["a|b", "{x:+.1%}"], ["y", "{y}"]], [{"x": 0.006, "y": "p|q"}, {"x": None}])
    assert table.splitlines() == ["| a\\|b | y |", "|---|---|", "| +0.6% | p\\|q |", f"| {MISSING} | {MISSING} |"]


def test_no_bench_module_edits_sys_path():
    """Benches run as modules of the ``bench`` package (python -m bench.X.Y) and import mlaconv as installed."""
    edits = [str(path.relative_to(ROOT)) for path in (ROOT / "bench").rglob("*.py")
             if "_work" not in path.parts and "sys.path" in path.read_text(encoding="utf-8")]
    assert edits == []
