"""The output appears atomically or not at all (existing outputs, overlap with the source, a full disk, a killed
or interrupted run), the writer streams, and the same inputs give the same bytes (issue 7)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import MLACONV, RANK, assert_refused, cli, hashes, leftovers, make_model, wait_for_writing
from mlaconv.io import ShardedWriter


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


def _start_conversion(src: Path, out: Path) -> subprocess.Popen:
    """``mlaconv convert`` in a subprocess, one shard per tensor so that it writes all along."""
    return subprocess.Popen([sys.executable, "-c", MLACONV, "convert", str(src), str(out), *RANK, "--shard-size", "1KB"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def slow_src(tmp_path) -> Path:
    """Many small layers: the conversion writes for a good while."""
    return make_model(tmp_path / "slow", heads=4, kv_heads=2, hidden=32, head_dim=16, layers=96)


def test_a_killed_conversion_leaves_no_output_and_the_next_run_sweeps_its_temporary(slow_src, tmp_path):
    out = tmp_path / "out"
    before = hashes(slow_src)
    process = _start_conversion(slow_src, out)
    temporary = wait_for_writing(process, out)
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
    temporary = wait_for_writing(process, out)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted: nothing was written to the output" in stderr
    assert not temporary.exists() and not out.exists() and leftovers(out) == []


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
