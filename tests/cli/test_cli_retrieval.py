"""``mlaconv eval retrieval``: the documented JSON, progress and the report on stderr, bad input in one line."""

from __future__ import annotations

import json

import pytest

from helpers import PASSKEY_VOCAB, invoke, make_model, passkey_tokenizer

# The documented JSON of a run with a baseline, by level: key → type.
REPORT_KEYS = {"task": str, "model": str, "baseline": str, "tokenizer": str, "seed": int, "trials": int,
               "new_tokens": int, "dtype": str, "device": str, "accuracy": float, "baseline_accuracy": float,
               "lengths": list, "seconds": float}
LENGTH_KEYS = {"length": int, "prompt_tokens": list, "accuracy": float, "baseline_accuracy": float,
               "by_depth": list, "cases": list}
DEPTH_KEYS = {"start": float, "end": float, "trials": int, "accuracy": float, "baseline_accuracy": float}
CASE_KEYS = {"depth": float, "key": int, "prompt_tokens": int, "answer": str, "correct": bool,
             "baseline_answer": str, "baseline_correct": bool}


def cli(*args):
    return invoke("eval", "retrieval", *args)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = make_model(tmp_path_factory.mktemp("retrieval") / "source", vocab=PASSKEY_VOCAB)
    passkey_tokenizer().save_pretrained(folder)
    return folder


def typed(obj: dict, keys: dict) -> None:
    assert set(obj) == set(keys)
    for key, kind in keys.items():
        assert isinstance(obj[key], kind), key


def test_json_output_has_the_documented_keys_and_the_report_and_progress_go_to_stderr(source):
    result = cli(source, "--baseline", source, "--lengths", "128,256", "--trials", 3, "--seed", 7, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    typed(report, REPORT_KEYS)
    assert [length["length"] for length in report["lengths"]] == [128, 256]
    assert (report["trials"], report["seed"], report["task"]) == (3, 7, "passkey")
    for length in report["lengths"]:
        typed(length, LENGTH_KEYS)
        assert len(length["cases"]) == 3 and sum(b["trials"] for b in length["by_depth"]) == 3
        for bucket in length["by_depth"]:
            typed(bucket, DEPTH_KEYS)
        for case in length["cases"]:
            typed(case, CASE_KEYS)
    assert report["accuracy"] == report["baseline_accuracy"]
    assert "passkey: right answers" in result.stderr
    assert "passkey, baseline 6/6 done" in result.stderr and "passkey, model 6/6 done" in result.stderr  # progress


def test_the_human_report_lists_both_models_per_length(source):
    result = cli(source, "--baseline", source, "--lengths", "256", "--trials", 2, "--quiet")
    assert result.exit_code == 0, result.output
    assert "passkey, " not in result.stderr  # --quiet: no progress
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in result.stdout.splitlines()
            if line.startswith("│")]
    assert [(row[0], row[2], row[3]) for row in rows] == [("256", "baseline", "0/2 (0%)"), ("", "model", "0/2 (0%)")]
    assert result.stdout.splitlines()[-1] == f"all lengths: baseline {source} 0/2 (0%); model {source} 0/2 (0%)"


@pytest.mark.parametrize("args, message", [
    (["--lengths", "1k"], "--lengths 1024 is longer than the models' context (256 tokens)"),
    ([], "--lengths 1024 is longer than the models' context (256 tokens)"),  # the shortest default
    (["--lengths", "1x,2k"], "--lengths '1x,2k': expected token counts separated by commas"),
    (["--lengths", "128,,256"], "expected token counts separated by commas"),
    (["--lengths", "16"], "--lengths 16 is too short"),
    (["--trials", "0"], "--trials must be at least 1, not 0"),
    (["--dtype", "float8"], "unknown --dtype 'float8'"),
])
def test_bad_input_is_one_line_and_a_json_error(source, args, message):
    result = cli(source, *args, "--json")
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)
    assert error["kind"] == "input" and message in error["error"] and set(error) == {"error", "kind"}
    assert result.stderr.strip().splitlines() == [f"error: {error['error']}"]

    plain = cli(source, *args)
    assert plain.exit_code == 1 and plain.stdout == ""
    assert plain.stderr.strip().splitlines() == [f"error: {error['error']}"]
