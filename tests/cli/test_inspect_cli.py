"""``mlaconv inspect spectra``: JSON, table, CSV and PNG from the command line, and bad input in one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mlaconv.cli import app
from helpers import check_schema

runner = CliRunner()


def test_cli_json_table_csv_and_plot(stories, tmp_path):
    result = runner.invoke(app, ["inspect", "spectra", str(stories), "--ranks", "24,8", "--kv-keep", "0.5", "--json",
                                 "--csv", str(tmp_path / "s.csv"), "--plot", str(tmp_path / "s.png")])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    check_schema(report)
    assert report["ranks"] == [8, 24] and report["energy_targets"] == [0.9, 0.95, 0.99]
    assert "r@95%" in result.stderr and "worst" in result.stderr and "--kv-keep 0.5: r = 24, R = 8" in result.stderr
    assert (tmp_path / "s.csv").is_file() and (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_without_json_prints_the_table_on_stdout(stories):
    result = runner.invoke(app, ["inspect", "spectra", str(stories), "--energy", "0.95"])
    assert result.exit_code == 0, result.stderr
    assert "r=56" in result.stdout and "r@95%" in result.stdout and "full rank 56" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["{missing}"], "no such folder"),
    (["{unsupported}"], "cannot convert model_type 'gpt2'"),
    (["{stories}", "--ranks", "0"], "outside 1..56"),
    (["{stories}", "--ranks", "64"], "outside 1..56"),
    (["{stories}", "--ranks", "8,x"], "comma-separated int"),
    (["{stories}", "--energy", "0"], r"in (0, 1]"),
    (["{stories}", "--energy", "1.2"], r"in (0, 1]"),
    (["{stories}", "--rope-dim", "5"], "even number"),
    (["{stories}", "--kv-keep", "2"], "--kv-keep must be in"),
    (["{stories}", "--plot", "{tmp}/missing/s.png"], "does not exist"),
    (["{stories}", "--plot", "{tmp}/s.jpg"], "must end in .png"),
    (["{stories}", "--csv", "{tmp}/missing/s.csv"], "does not exist"),
])
def test_cli_bad_input_is_one_line_and_non_zero(args, message, stories, tmp_path):
    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    names = {"missing": tmp_path / "nope", "unsupported": unsupported, "stories": stories, "tmp": tmp_path}
    result = runner.invoke(app, ["inspect", "spectra", *(a.format(**names) for a in args), "--json"])
    assert result.exit_code == 1
    error = json.loads(result.stdout)
    assert error["kind"] == "input" and message in error["error"]
    lines = result.stderr.strip().splitlines()
    assert lines == [f"error: {error['error']}"], result.stderr
