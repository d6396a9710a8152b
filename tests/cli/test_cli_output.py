"""How every command talks: progress lines in a log, --quiet, one JSON object on stdout even on failure."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from helpers import STORIES
from mlaconv.cli import app
from mlaconv.progress import LineProgress

PROGRESS_LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<stage>.+) (?P<done>\d+)/(?P<total>\d+)\b")


def commands() -> list[tuple[str, ...]]:
    """Every registered command, as the words that invoke it (``("eval", "perplexity")`` …)."""
    found = []

    def walk(command, path):
        children = getattr(command, "commands", None)
        if children is None:
            found.append(tuple(path))
            return
        for name, child in children.items():
            walk(child, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def run(*args, env: dict | None = None):
    return CliRunner(env=env).invoke(app, [*map(str, args)])


def progress_lines(text: str) -> list[re.Match]:
    return [match for match in map(PROGRESS_LINE.match, text.splitlines()) if match]


# --- plain progress lines -----------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_line_progress_writes_the_start_first_last_and_one_line_per_interval():
    stream, clock = io.StringIO(), FakeClock()
    track = LineProgress(stream, interval=5.0, clock=clock)
    for _ in track(range(10), "converting layers", 10):
        clock.now += 2.0  # each item takes 2 s: lines after items 1, 3 (6 s after the last line), 6, 9 and 10
    lines = stream.getvalue().splitlines()
    assert [PROGRESS_LINE.match(text)["done"] for text in lines] == ["0", "1", "4", "7", "10"]
    assert lines[1].endswith("converting layers 1/10 (10%), elapsed 0:02, ~0:18 left")
    assert lines[2].endswith("converting layers 4/10 (40%), elapsed 0:08, ~0:12 left")
    assert lines[-1].endswith("converting layers 10/10 done in 0:20")


def test_line_progress_counts_hours_and_writes_through_at_once():
    class Unbuffered(io.StringIO):
        flushes = 0

        def flush(self):
            self.flushes += 1

    stream, clock = Unbuffered(), FakeClock()
    items = LineProgress(stream, clock=clock)(range(2), "scoring windows", 2)
    next(items)
    clock.now = 3725.0
    next(items, None)
    assert stream.getvalue().splitlines()[-1].endswith("scoring windows 1/2 (50%), elapsed 1:02:05, ~1:02:05 left")
    assert stream.flushes == 2


def test_a_calibrated_conversion_logs_progress_into_a_redirected_stderr_while_it_runs(tmp_path):
    """stderr is a file (not a terminal): the progress lines are in it before the process ends."""
    log = tmp_path / "stderr.log"
    with log.open("w") as stderr, (tmp_path / "stdout.txt").open("w") as stdout:
        process = subprocess.Popen(
            [sys.executable, "-m", "mlaconv", "convert", str(STORIES), str(tmp_path / "out"), "--rank", "24",
             "--calib", str(STORIES / "samples.jsonl"), "--calib-window", "64", "--calib-tokens", "1024",
             "--no-verify"], stdout=stdout, stderr=stderr)
        seen_while_running = []
        deadline = time.monotonic() + 600
        while process.poll() is None and time.monotonic() < deadline:
            lines = progress_lines(log.read_text())
            if lines and process.poll() is None:
                seen_while_running = [line.group(0) for line in lines]
            time.sleep(0.05)
        if process.poll() is None:
            process.kill()
        process.wait()
    assert process.returncode == 0, log.read_text()
    assert any("converting layers 1/5" in text for text in seen_while_running), seen_while_running
    stages = progress_lines(log.read_text())
    assert [m.group(0)[9:] for m in stages if m["stage"] == "converting layers"][0] == "converting layers 0/5"
    assert "converting layers 5/5 done in" in log.read_text()
    assert "converted" in (tmp_path / "stdout.txt").read_text()  # the report went to stdout, not the log


def test_a_terminal_gets_live_bars_not_log_lines(tmp_path):
    """stderr on a pseudo-terminal: rich draws its bars there, and no plain progress line is written."""
    import os
    import pty

    leader, follower = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "mlaconv", "convert", str(STORIES), str(tmp_path / "out"),
                                "--rank", "8", "--no-verify"], stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    drawn = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process is done
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    assert process.wait(timeout=600) == 0, drawn.decode(errors="replace")
    text = drawn.decode(errors="replace")
    assert "converting layers" in text and "\x1b[" in text  # a bar, drawn with terminal control sequences
    assert progress_lines(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "\n")) == []


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "ids.jsonl"
    path.write_text("".join(line + "\n" for line in (STORIES / "samples.jsonl").read_text().splitlines()[:2]))
    return path


def quick_run(command: str, out: Path, tokens: Path) -> list[str]:
    """A cheap successful run of each command."""
    return {
        "convert": ["convert", STORIES, out, "--rank", "8", "--no-verify"],
        "inspect spectra": ["inspect", "spectra", STORIES],
        "eval perplexity": ["eval", "perplexity", STORIES, "--tokens", tokens],
        "bench decode": ["bench", "decode", "--contexts", "16", "--shapes", "llama3-8b", "--dtypes", "float32",
                         "--devices", "cpu", "--repeats", "1", "--warmup", "0", "--warm", "--no-expanded"],
    }[command]


@pytest.mark.parametrize("command", ["convert", "inspect spectra", "eval perplexity", "bench decode"])
def test_progress_goes_to_a_non_terminal_stderr_and_quiet_turns_it_off(command, tmp_path, tokens_file):
    loud = run(*quick_run(command, tmp_path / "a", tokens_file), "--json")
    quiet = run(*quick_run(command, tmp_path / "b", tokens_file), "--json", "--quiet")
    assert loud.exit_code == 0 and quiet.exit_code == 0, loud.output + quiet.output
    assert progress_lines(loud.stderr), loud.stderr
    assert progress_lines(quiet.stderr) == [] and quiet.stderr.strip()  # the report still goes to stderr
    assert json.loads(quiet.stdout)  # and the JSON to stdout


def test_every_command_takes_json_and_quiet():
    found = commands()
    assert {" ".join(path) for path in found} >= {"convert", "inspect spectra", "eval perplexity", "bench decode"}
    for path in found:
        result = run(*path, "--help", env={"COLUMNS": "200"})
        assert result.exit_code == 0, path
        assert "--json" in result.stdout and "--quiet" in result.stdout, path


# --- tables and lines in a log: never cut to the terminal width --------------------------------------------


def test_a_calibrated_summary_in_a_narrow_log_is_whole(tmp_path):
    ids = [json.loads(line)["input_ids"][:64] for line in (STORIES / "samples.jsonl").read_text().splitlines()[:4]]
    (tmp_path / "calib.jsonl").write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids))
    result = run("convert", STORIES, tmp_path / "out", "--rank", "24", "--no-verify", "--calib", tmp_path / "calib.jsonl",
                 "--calib-window", "64", "--quiet", "--json", env={"COLUMNS": "40"})
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert "…" not in result.stderr
    rows = [text for text in result.stderr.splitlines() if re.match(r"^│\s+\d\s+│", text)]
    assert len(rows) == 5
    columns = (report["energy_retained"]["per_layer"], report["rope_energy_kept"], report["key_error"],
               report["value_error"], report["attention_error"])
    for i, text in enumerate(rows):  # one line per layer, every cell whole
        cells = [cell.strip() for cell in text.strip().strip("│").split("│")]
        assert cells == [str(i), *(f"{column[i]:.4f}" for column in columns), report["layer_variant"][i]]
    calibration = report["calibration"]
    assert (calibration["refine_steps"], calibration["refine_batch"], calibration["refine_queries"],
            calibration["refine_windows"]) == (150, 2, 8, 2)
    steps = " (150 steps of 2 windows a layer drawn from 2 fit windows, each error at 8 positions a window)"  # 64 / 8
    lines = result.stderr.splitlines()
    assert (f"calibration: 4 windows of 64 tokens (2 fit, 1 select, 1 audit); refinement: "
            f"{calibration['refinement']}{steps}") in lines, result.stderr
    whole = calibration["whole_model"]
    assert any(text.startswith("whole model on the 1 audit windows (64 tokens): closed form KL ")
               and text.endswith(f"written: {whole['written']} ({whole['reason']})") for text in lines), result.stderr


# --- --json on failure --------------------------------------------------------------------------------------


def assert_json_error(result, kind: str, code: int, message: str) -> dict:
    """Exactly one JSON object on stdout, the one-line error on stderr, the exit status."""
    assert result.exit_code == code, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    error = json.loads(lines[0])
    assert set(error) == {"error", "kind"} and error["kind"] == kind and message in error["error"], error
    return error


@pytest.mark.parametrize("args, message", [
    (["convert", "/nonexistent", "{tmp}/out", "--rank", "8"], "no such folder: /nonexistent"),
    (["inspect", "spectra", "/nonexistent"], "no such folder: /nonexistent"),
    (["eval", "perplexity", "/nonexistent", "--tokens", "{tmp}/ids.jsonl"], "no such folder: /nonexistent"),
    (["eval", "perplexity", str(STORIES)], "give exactly one of"),
    (["bench", "decode", "--contexts", "0"], "a context must be ≥ 1 token"),
])
def test_bad_input_with_json_is_one_json_error_object(args, message, tmp_path):
    result = run(*(arg.format(tmp=tmp_path) for arg in args), "--json")
    error = assert_json_error(result, "input", 1, message)
    errors = [text for text in result.stderr.splitlines() if text.strip()]
    assert errors == [f"error: {error['error']}"]
    without = run(*(arg.format(tmp=tmp_path) for arg in args))
    assert without.exit_code == 1 and without.stdout == "" and without.stderr == result.stderr


@pytest.mark.parametrize("path", commands(), ids=" ".join)
def test_a_command_line_click_refuses_is_a_json_usage_error(path):
    result = run(*path, "--no-such-option", "--json")
    assert_json_error(result, "usage", 2, "No such option: --no-such-option")
    assert "Usage:" in result.stderr
    plain = run(*path, "--no-such-option")
    assert plain.exit_code == 2 and plain.stdout == ""


def test_a_bad_option_value_is_a_json_usage_error(tmp_path):
    result = run("convert", STORIES, tmp_path / "out", "--rank", "many", "--json")
    assert_json_error(result, "usage", 2, "'--rank'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("failure, kind, code, message", [
    (RuntimeError("boom\nsecond line"), "internal", 2, "unexpected RuntimeError: boom (rerun with --debug"),
    (KeyboardInterrupt(), "interrupted", 130, "nothing was written to the output"),
])
def test_unexpected_failures_and_interrupts_are_json_errors_too(failure, kind, code, message, tmp_path, monkeypatch,
                                                                 tokens_file):
    import mlaconv.conversion.run
    import mlaconv.evaluate.perplexity
    import mlaconv.runtime.bench
    import mlaconv.inspect.spectra

    def broken(*args, **kwargs):
        raise failure

    for module, name in ((mlaconv.conversion.run, "convert"), (mlaconv.inspect.spectra, "spectra"),
                         (mlaconv.evaluate.perplexity, "evaluate_perplexity"), (mlaconv.runtime.bench, "run_decode_bench")):
        monkeypatch.setattr(module, name, broken)
    for args in (["convert", STORIES, tmp_path / "out", "--rank", "8"], ["inspect", "spectra", STORIES],
                 ["eval", "perplexity", STORIES, "--tokens", tokens_file], ["bench", "decode"]):
        result = run(*args, "--json")
        assert_json_error(result, kind, code, message)
        assert len([text for text in result.stderr.splitlines() if text.strip()]) == 1, result.stderr


def test_version_prints_the_package_version():
    from mlaconv import __version__

    result = run("--version")
    assert (result.exit_code, result.stdout) == (0, f"{__version__}\n"), result.output
