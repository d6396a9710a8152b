"""convert --eval-retrieval: the passkey table of the fresh conversion against its source, in the report and the card."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from helpers import ROOT, assert_refused
from mlaconv.cli import app

EXAMPLE = ROOT / "examples" / "llama-docs"  # a tokenizer and a 256-token context


def test_retrieval_after_converting_is_reported_and_carded(tmp_path):
    result = CliRunner().invoke(app, ["convert", "--json", str(EXAMPLE), str(tmp_path / "out"), "--weights-only",
                                      "--rank", "64", "--rope-dim", "32", "--no-verify", "--eval-retrieval", "200,240"])
    assert result.exit_code == 0, result.output
    retrieval = json.loads(result.stdout.strip().splitlines()[-1])["retrieval"]
    assert [length["length"] for length in retrieval["lengths"]] == [200, 240]
    assert retrieval["baseline"] == str(EXAMPLE) and retrieval["model"] == str(tmp_path / "out")
    assert all(0 <= length["baseline_accuracy"] <= 1 for length in retrieval["lengths"])
    card = (tmp_path / "out" / "README.md").read_text()
    assert "## Long-context retrieval" in card and "| 240 |" in card


def test_a_length_over_the_context_is_refused_before_converting(tmp_path):
    result = CliRunner().invoke(app, ["convert", str(EXAMPLE), str(tmp_path / "out"), "--weights-only", "--rank", "64",
                                      "--eval-retrieval", "1k"])
    assert_refused(result, tmp_path / "out", match="longer than the model's context")
