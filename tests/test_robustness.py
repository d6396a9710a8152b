"""Trustworthy at scale (issue 7): bad input fails in one line with nothing written, outputs appear
atomically, the source is never touched, pickles run no code, and the same inputs give the same bytes."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from conftest import ROOT, make_model
from mlaconv.cli import app
from mlaconv.io import ShardedWriter

RANK = ["--rank", "16", "--rope-dim", "8", "--no-verify"]  # head_dim 16 in every tiny model here


def cli(*args: str | Path):
    """``mlaconv convert --quiet``: what is left on stderr is errors and warnings."""
    return CliRunner().invoke(app, ["convert", "--quiet", *map(str, args)])


def hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path (so a new or missing file shows too)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f".{out.name}.mlaconv-*"))


def assert_refused(result, out: Path, source: Path | None = None, before: dict | None = None,
                   match: str = "") -> str:
    """Non-zero exit, one ``error:`` line and no traceback, no OUT, no temporary, the source unchanged."""
    assert result.exit_code not in (0, None), result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert match.lower() in lines[0].lower(), lines[0]
    assert not out.exists()
    assert leftovers(out) == []
    if source is not None:
        assert hashes(source) == before
    return lines[0]


@pytest.fixture
def src(tmp_path) -> Path:
    return make_model(tmp_path / "src", heads=4, kv_heads=2, hidden=32, head_dim=16)


# --- bad input ----------------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    assert_refused(cli(tmp_path / "nowhere", tmp_path / "out", *RANK), tmp_path / "out", match="no such folder")


def test_a_folder_that_is_not_a_model(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"\xff\xd8\xff")
    before = hashes(folder)
    assert_refused(cli(folder, tmp_path / "out", *RANK), tmp_path / "out", folder, before, "has no config.json")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    assert_refused(cli(folder, tmp_path / "out", *RANK), tmp_path / "out", match="lacks 'num_attention_heads'")
    (folder / "config.json").write_text("{not json")
    assert_refused(cli(folder, tmp_path / "out", *RANK), tmp_path / "out", match="not valid JSON")


def test_a_model_folder_without_weights(src, tmp_path):
    (src / "model.safetensors").unlink()
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "holds no weights")


@pytest.mark.parametrize("model_type, match", [("gpt2", "cannot convert model_type 'gpt2'"),
                                               ("bert", "unsupported architecture 'bert'")])
def test_unsupported_architecture(src, tmp_path, model_type, match):
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"model_type": model_type}))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, match)


def test_config_and_weights_disagree(src, tmp_path):
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                   "tensor model.layers.1.mlp.up_proj.weight is missing")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"intermediate_size": 48}))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                   "model.layers.0.mlp.gate_proj.weight has shape [64, 32], expected [48, 32]")


@pytest.mark.parametrize("key, value, match", [
    ("num_attention_heads", 0, "num_attention_heads = 0 is not a positive int"),
    ("hidden_size", "32", "hidden_size = '32' is not a positive int"),
    ("num_hidden_layers", 1.5, "num_hidden_layers = 1.5 is not a positive int"),
    ("rms_norm_eps", "tiny", "rms_norm_eps = 'tiny' is not a positive float"),
    ("rope_theta", "1e4", "rope_theta = '1e4' is not a positive number"),
    ("rope_scaling", [8.0], "rope_scaling = [8.0] is not a mapping"),
])
def test_malformed_config_numbers(src, tmp_path, key, value, match):
    config = json.loads((src / "config.json").read_text())
    config.pop("rope_parameters", None)  # a transformers 4.x config: rope_theta and rope_scaling at the top level
    (src / "config.json").write_text(json.dumps(config | {key: value}))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, match)


def test_a_weight_index_that_maps_to_non_names(src, tmp_path):
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": 3}}))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                   "weight_map must map names to file names")


def test_truncated_and_corrupt_safetensors(src, tmp_path):
    weights = src / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) * 2 // 3])
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "truncated")
    weights.write_bytes(whole[:8] + b"\x00garbage" + whole[16:])
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "header is not JSON")
    weights.write_bytes(b"<html>rate limited</html>")
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", match="not a readable safetensors file")


def test_a_sharded_checkpoint_with_a_missing_shard(src, tmp_path):
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                   "model.safetensors.index.json names model-00002-of-00002.safetensors, which is missing")


def test_a_truncated_pickle_checkpoint(src, tmp_path):
    pickled = _as_pickle(src) / "pytorch_model.bin"
    pickled.write_bytes(pickled.read_bytes()[:3000])
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                   "pytorch_model.bin cannot be loaded (truncated or corrupt?)")


@pytest.mark.parametrize("name, value", [("model.layers.1.mlp.down_proj.weight", float("nan")),
                                         ("model.layers.0.self_attn.k_proj.weight", float("inf")),
                                         ("model.embed_tokens.weight", float("-inf"))])
def test_nan_or_inf_weights(src, tmp_path, name, value):
    """Found mid-conversion (after some shards are written): nothing of it may remain."""
    state = load_file(src / "model.safetensors")
    state[name][3, 5] = value
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK, "--shard-size", "1KB"), tmp_path / "out", src, before,
                   f"tensor {name} in model.safetensors contains NaN or Inf")


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
    import mlaconv.conversion

    def broken(*args, **kwargs):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(mlaconv.conversion, "convert_attention", broken)
    line = assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", match="unexpected RuntimeError")
    assert line == "error: unexpected RuntimeError: first line (rerun with --debug for the traceback)"


# --- atomic, never destructive ------------------------------------------------------------------------------


def test_an_existing_output_is_refused_without_force_and_kept_when_a_forced_run_fails(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("precious")
    before = hashes(out)
    result = cli(src, out, *RANK)
    assert result.exit_code == 1 and result.stderr.strip() == f"error: {out} already exists; pass --force to replace it"
    assert hashes(out) == before
    state = load_file(src / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    assert cli(src, out, *RANK, "--force").exit_code == 1  # fails mid-way: the old OUT stays as it was
    assert hashes(out) == before and leftovers(out) == []


def test_force_replaces_the_output_and_the_source_is_never_written(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("old")
    before = hashes(src)
    result = cli(src, out, *RANK, "--force")
    assert result.exit_code == 0, result.output
    assert not (out / "mine.txt").exists() and (out / "model.safetensors.index.json").is_file()
    assert hashes(src) == before and leftovers(out) == []


@pytest.mark.parametrize("inside", [True, False])
def test_output_overlapping_the_source_is_refused(src, tmp_path, inside):
    out = src / "mla" if inside else src
    before = hashes(src)
    result = cli(src, out, *RANK, "--force")
    assert result.exit_code == 1 and "overlaps the source folder" in result.stderr
    assert hashes(src) == before and not (src / "mla").exists()


def test_free_space_is_checked_before_writing(src, tmp_path, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "not enough free disk space")


def test_an_output_that_cannot_be_created(src, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    result = cli(src, tmp_path / "file" / "out", *RANK)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().startswith(f"error: cannot create the output folder {tmp_path / 'file' / 'out'}: ")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "file" / "out").exists()


def test_a_disk_that_fills_up_mid_way(src, tmp_path, monkeypatch):
    import errno

    writes = []

    def full(self, name, tensor):
        writes.append(name)
        if len(writes) == 5:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.folder / "model-00001.partial.safetensors"))

    monkeypatch.setattr(ShardedWriter, "add", full)
    before = hashes(src)
    line = assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "No space left on device")
    assert line.endswith(f"; nothing was written to {tmp_path / 'out'}")


# ``python -m mlaconv``, with Ctrl-C raising KeyboardInterrupt even where the tests run as a background job
# (which starts with SIGINT ignored, and Python then leaves it ignored)
MLACONV = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "runpy.run_module('mlaconv', run_name='__main__', alter_sys=True)")


def _start_conversion(src: Path, out: Path) -> subprocess.Popen:
    """``mlaconv convert`` in a subprocess, one shard per tensor so that it writes all along."""
    return subprocess.Popen([sys.executable, "-c", MLACONV, "convert", str(src), str(out), *RANK, "--shard-size", "1KB"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_writing(process: subprocess.Popen, out: Path) -> Path:
    """The temporary folder, once the conversion has written its first shard into it."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        temporaries = list(out.parent.glob(f".{out.name}.mlaconv-tmp-*"))
        if temporaries and any(temporaries[0].glob("*.safetensors")):
            return temporaries[0]
        assert process.poll() is None, f"the conversion ended before it was interrupted: {process.communicate()}"
        time.sleep(0.002)
    process.kill()
    raise AssertionError("the conversion never started writing")


@pytest.fixture
def slow_src(tmp_path) -> Path:
    """Many small layers: the conversion writes for a good while."""
    return make_model(tmp_path / "slow", heads=4, kv_heads=2, hidden=32, head_dim=16, layers=96)


def test_a_killed_conversion_leaves_no_output_and_the_next_run_sweeps_its_temporary(slow_src, tmp_path):
    out = tmp_path / "out"
    before = hashes(slow_src)
    process = _start_conversion(slow_src, out)
    temporary = _wait_for_writing(process, out)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    assert temporary.is_dir() and not out.exists()  # what a kill leaves: a stale temporary, never a partial OUT
    result = cli(slow_src, out, *RANK)
    assert result.exit_code == 0, result.output
    assert not temporary.exists() and leftovers(out) == []
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) == 3 + 96 * 10
    assert hashes(slow_src) == before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_remove_the_temporary_folder(slow_src, tmp_path, signum):
    out = tmp_path / "out"
    process = _start_conversion(slow_src, out)
    temporary = _wait_for_writing(process, out)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted: nothing was written to the output" in stderr
    assert not temporary.exists() and not out.exists() and leftovers(out) == []


# --- untrusted files ----------------------------------------------------------------------------------------


def _as_pickle(folder: Path) -> Path:
    """The same model as ``pytorch_model.bin`` (what ``save_pretrained(safe_serialization=False)`` wrote)."""
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


def test_a_pickle_checkpoint_converts_with_one_warning_line(tmp_path):
    make_model(tmp_path / "safe", heads=4, kv_heads=2, hidden=32, head_dim=16)
    pickled = _as_pickle(make_model(tmp_path / "pickled", heads=4, kv_heads=2, hidden=32, head_dim=16))
    before = hashes(pickled)
    result = cli(pickled, tmp_path / "from-bin", *RANK)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"warning: {pickled} holds pickle weights (.bin): loading them with torch.load(weights_only=True), "
                     "which refuses anything but tensors; prefer safetensors"]
    assert hashes(pickled) == before
    assert cli(tmp_path / "safe", tmp_path / "from-safetensors", *RANK).exit_code == 0
    shards = sorted((tmp_path / "from-bin").glob("*.safetensors"))
    assert shards and all(p.read_bytes() == (tmp_path / "from-safetensors" / p.name).read_bytes() for p in shards)


class _Payload:
    """Unpickling this creates the marker file: what a malicious checkpoint would do, harmlessly."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_malicious_pickle_is_refused_and_runs_nothing(src, tmp_path):
    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    torch.save(state | {"extra": _Payload(tmp_path / "pwned")}, src / "pytorch_model.bin")
    before = hashes(src)
    line = assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                          "pytorch_model.bin is refused: it is a pickle that holds more than tensors")
    assert "(it would call io.open)" in line
    assert not (tmp_path / "pwned").exists()
    # the payload is live: loading without weights_only would have run it
    torch.load(src / "pytorch_model.bin", weights_only=False)
    assert (tmp_path / "pwned").exists()


def test_custom_code_is_refused(src, tmp_path):
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"auto_map": {"AutoModelForCausalLM": "modeling.MyModel"}}))
    (src / "modeling.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w')\n")
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "custom code (auto_map)")
    assert not (tmp_path / "pwned").exists()


def test_remote_code_is_never_trusted():
    sources = ROOT / "src" / "mlaconv"
    uses = [line.strip() for path in sources.rglob("*.py") for line in path.read_text().splitlines()
            if "trust_remote_code" in line and "trust_remote_code`" not in line]
    assert uses and all("False" in line for line in uses), uses


# --- deterministic ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, extra", [(torch.float32, []), (torch.bfloat16, []), (torch.float32, ["--dtype", "bfloat16"])])
def test_weights_only_output_is_byte_identical(tmp_path, dtype, extra):
    src = make_model(tmp_path / "src", heads=4, kv_heads=2, hidden=32, head_dim=16, dtype=dtype)
    out = tmp_path / "out"
    assert cli(src, out, *RANK, *extra).exit_code == 0
    first = hashes(out)
    assert cli(src, out, *RANK, *extra, "--force").exit_code == 0
    assert hashes(out) == first
    written = {t.dtype for shard in out.glob("*.safetensors") for t in load_file(shard).values()}
    assert written == {torch.float32 if dtype == torch.float32 and not extra else torch.bfloat16}


# --- the writer streams -------------------------------------------------------------------------------------


@pytest.mark.parametrize("reserve", [8, 2**16])
def test_the_writer_holds_no_tensor_and_writes_valid_safetensors(tmp_path, reserve):
    """Each tensor is on disk when ``add`` returns (changing it afterwards changes nothing), in shards that
    safetensors reads back exactly, whether the header fits its reserve or the data has to move."""
    tensors = {f"t{i}": torch.randn(3 + i, 5, generator=torch.Generator().manual_seed(i)).to(dtype)
               for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float64] * 3)}
    tensors["empty"] = torch.zeros(0, 4)
    tensors["flag"] = torch.tensor([True, False])
    expected = {name: t.clone() for name, t in tensors.items()}
    writer = ShardedWriter(tmp_path, max_shard_bytes=200, header_reserve=reserve)
    for name in list(tensors):
        tensor = tensors.pop(name)
        writer.add(name, tensor)
        ref = weakref.ref(tensor)
        tensor.fill_(7)
        del tensor
        assert ref() is None, f"the writer kept {name}"
    index = writer.finish()
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and not list(tmp_path.glob("*.partial*")) and not list(tmp_path.glob("*.moving"))
    read = {name: t for shard in shards for name, t in load_file(shard).items()}
    assert read.keys() == expected.keys() == index["weight_map"].keys()
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
