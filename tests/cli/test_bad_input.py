"""Bad command lines and options: one error line (the traceback only with --debug), nothing written (issue 7)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import RANK, assert_refused, cli, hashes, make_model


def test_missing_path(tmp_path):
    assert_refused(cli(tmp_path / "nowhere", tmp_path / "out", *RANK), tmp_path / "out", match="no such folder")


@pytest.mark.parametrize("model_type, match", [("gpt2", "cannot convert model_type 'gpt2'"),
                                               ("bert", "unsupported architecture 'bert'")])
def test_unsupported_architecture(src, tmp_path, model_type, match):
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"model_type": model_type}))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, match)


@pytest.mark.parametrize("options, match", [
    (["--rank", "0"], "--rank must be ≥ 1, got 0"),
    (["--rank", "-3"], "--rank must be ≥ 1, got -3"),
    (["--rank", "33"], "--rank 33 is larger than the matrix allows: at most 32"),
    (["--rank", "8", "--rope-dim", "7"], "--rope-dim must be an even number"),
    (["--rank", "8", "--rope-dim", "32"], "--rope-dim 32 is larger than the source head_dim 16"),
    (["--kv-keep", "0.05", "--rope-dim", "8"], "too few for --rope-dim 8 plus a latent"),
    (["--kv-keep", "0"], "--kv-keep must be in (0, 1]"),
    (["--kv-keep", "1.5"], "--kv-keep must be in (0, 1]"),
    (["--kv-keep", "-0.2"], "--kv-keep must be in (0, 1]"),
    (["--rank", "8", "--kv-keep", "0.5"], "give exactly one of --rank and --kv-keep"),
    (["--rank", "8", "--dtype", "float16"], "float16 output is refused"),
    (["--rank", "8", "--dtype", "int8"], "--dtype must be one of"),
    (["--rank", "8", "--shard-size", "lots"], "cannot read the size"),
])
def test_bad_options(src, tmp_path, options, match):
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *options, "--no-verify"), tmp_path / "out", src, before, match)


def test_float16_source_needs_another_output_dtype(tmp_path):
    src = make_model(tmp_path / "src", heads=4, kv_heads=2, hidden=32, head_dim=16, dtype=torch.float16)
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "use --dtype bfloat16 or float32")
    assert cli(src, tmp_path / "out", *RANK, "--dtype", "float32").exit_code == 0


def test_calibration_shorter_than_one_window(src, tmp_path):
    (tmp_path / "calib.jsonl").write_text(json.dumps({"input_ids": list(range(10))}) + "\n")
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK, "--calib", tmp_path / "calib.jsonl", "--calib-window", "32"),
                   tmp_path / "out", src, before, "shorter than one window of 32 tokens")
    assert_refused(cli(src, tmp_path / "out", *RANK, "--calib", tmp_path / "missing.txt"), tmp_path / "out",
                   match="calibration file not found")


def test_unknown_dataset_offline(src, tmp_path, monkeypatch):
    import datasets
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK, "--calib-dataset", "nobody/no-such-dataset"), tmp_path / "out",
                   src, before, "cannot load dataset nobody/no-such-dataset")


def test_debug_shows_the_traceback(src, tmp_path):
    result = cli(src, tmp_path / "out", "--rank", "0", "--debug")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "MlaconvError" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: --rank must be ≥ 1, got 0"


def test_an_unexpected_failure_is_one_line_too(src, tmp_path, monkeypatch):
    import mlaconv.conversion.weights_only

    def broken(*args, **kwargs):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(mlaconv.conversion.weights_only, "convert_attention", broken)
    line = assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", match="unexpected RuntimeError")
    assert line == "error: unexpected RuntimeError: first line (rerun with --debug for the traceback)"
