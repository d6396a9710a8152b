"""Source tensors that pass unchanged are copied file to file, unread (issue 16): the same bytes as reading and
writing them, the same NaN/Inf refusal, and a clear error when the source is cut short."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import RANK, assert_refused, cli, hashes, make_model
from mlaconv.conversion import weights_only
from mlaconv.errors import MlaconvError
from mlaconv.io import CheckpointReader, ShardedWriter
from mlaconv.io import writer as writer_module
from mlaconv.io.reader import read_safetensors_header
from mlaconv.target.layout import LayerWriter, scaled


def _source(folder) -> dict[str, torch.Tensor]:
    """A safetensors file of mixed dtypes and sizes (an empty tensor and a bool one among them)."""
    tensors = {f"t{i}": torch.randn(3 + i, 5, generator=torch.Generator().manual_seed(i)).to(dtype)
               for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float64] * 3)}
    tensors |= {"empty": torch.zeros(0, 4), "flag": torch.tensor([True, False])}
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    return tensors


def _write(folder, tensors, copied, reader=None, reserve=8, ahead=0) -> dict[str, str]:
    """Shards of 200 bytes; tensor number k is copied from ``reader`` when ``copied(k)``, else added."""
    folder.mkdir()
    with ShardedWriter(folder, max_shard_bytes=200, header_reserve=reserve, write_ahead=ahead) as writer:
        for k, (name, tensor) in enumerate(tensors.items()):
            writer.copy(name, reader.stored(name)) if copied(k) else writer.add(name, tensor)
        writer.finish()
    return hashes(folder)


@pytest.mark.parametrize("reserve", [8, 2**16])
@pytest.mark.parametrize("ahead", [0, 100])
@pytest.mark.parametrize("copied", [lambda k: True, lambda k: k % 2 == 1], ids=["all copied", "copy and add in turn"])
def test_a_copied_tensor_is_written_as_adding_it_writes_it(tmp_path, reserve, ahead, copied):
    """Shards of 200 bytes (the header moved or not, on the writer's thread or not): the same files."""
    tensors = _source(tmp_path / "src")
    reader = CheckpointReader(tmp_path / "src")
    added = _write(tmp_path / "added", tensors, lambda k: False, reserve=reserve, ahead=ahead)
    written = _write(tmp_path / "copied", tensors, copied, reader, reserve=reserve, ahead=ahead)
    assert written == added and len(written) > 3
    read = {n: t for shard in (tmp_path / "copied").glob("*.safetensors") for n, t in load_file(shard).items()}
    assert read.keys() == tensors.keys() and all(torch.equal(read[n], t) for n, t in tensors.items())


def _kernel_copy(monkeypatch, failure: str) -> None:
    """copy_file_range missing (not Linux), refused (two file systems), copying nothing (some kernels), or copying
    only some blocks."""
    if failure == "missing":
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    elif failure == "exdev":
        def refused(*args):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", refused)
    elif failure == "nothing copied":
        monkeypatch.setattr(os, "copy_file_range", lambda *args: 0)
    else:  # every other block: the kernel's copies and the block copies interleave in one tensor
        calls, kernel = [], os.copy_file_range
        monkeypatch.setattr(os, "copy_file_range", lambda *args: calls.append(0) or (kernel(*args) if len(calls) % 2
                                                                                     else 0))
    monkeypatch.setattr(writer_module._copy_bytes, "__defaults__", (7,))  # blocks of 7 bytes: many per tensor


@pytest.mark.parametrize("failure", ["missing", "exdev", "nothing copied", "some blocks"])
def test_without_the_kernel_copy_the_bytes_go_through_in_blocks(tmp_path, monkeypatch, failure):
    tensors = _source(tmp_path / "src")
    reader = CheckpointReader(tmp_path / "src")
    added = _write(tmp_path / "added", tensors, lambda k: False)
    _kernel_copy(monkeypatch, failure)
    assert _write(tmp_path / "copied", tensors, lambda k: True, reader) == added


@pytest.mark.parametrize("failure", [None, "nothing copied"])
@pytest.mark.parametrize("when", ["before the check", "after the check"])
def test_a_source_cut_short_is_an_error(tmp_path, monkeypatch, failure, when):
    _source(tmp_path / "src")
    reader = CheckpointReader(tmp_path / "src")
    if failure:
        _kernel_copy(monkeypatch, failure)
    entry = read_safetensors_header(tmp_path / "src" / "model.safetensors")["t11"]

    def cut() -> None:
        with open(tmp_path / "src" / "model.safetensors", "r+b") as handle:
            handle.truncate(entry.offset + 3)

    if when == "before the check":
        cut()
        with pytest.raises(MlaconvError, match="ended inside tensor t11"):
            reader.stored("t11")
    else:
        stored = reader.stored("t11")
        cut()
        (tmp_path / "out").mkdir()
        with ShardedWriter(tmp_path / "out") as writer, pytest.raises(MlaconvError, match="ended inside tensor t11"):
            writer.copy("t11", stored)


def test_stored_refuses_nan_and_gives_nothing_for_a_pickle(tmp_path):
    tensors = _source(tmp_path / "src")
    tensors["t1"][2, 3] = float("nan")
    save_file(tensors, tmp_path / "src" / "model.safetensors")
    reader = CheckpointReader(tmp_path / "src")
    assert reader.stored("t0").nbytes == tensors["t0"].numel() * 4
    with pytest.raises(MlaconvError, match="tensor t1 in model.safetensors contains NaN or Inf"):
        reader.stored("t1")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save({"w": torch.ones(2)}, pickled / "pytorch_model.bin")
    with pytest.warns(UserWarning, match="pickle"):
        assert CheckpointReader(pickled).stored("w") is None


MLP = {"model.norm.weight", "model.layers.2.mlp.up_proj.weight", "model.layers.0.post_attention_layernorm.weight"}
SCALED = {"model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"}


@pytest.mark.parametrize("eps, tied, dtype, expected", [
    (1e-6, False, None, MLP | SCALED | {"lm_head.weight"}),
    (1e-5, False, None, MLP | {"lm_head.weight"}),  # α ≠ 1: down_proj and the embedding are scaled
    (1e-5, True, None, MLP | {"lm_head.weight"}),  # the tied head: the embedding's bytes, unscaled
    (1e-6, False, "bfloat16", set()),
])
def test_unchanged_tensors_are_copied_and_the_output_is_the_same(tmp_path, monkeypatch, eps, tied, dtype, expected):
    """The MLP and norms are copied unread when nothing changes them (down_proj and the embedding only while the
    residual rescale is 1, i.e. ε = 1e-6; nothing once the dtype changes); the files are those of reading and
    writing every tensor."""
    src = make_model(tmp_path / "src", heads=4, kv_heads=2, hidden=32, head_dim=16, layers=3, eps=eps,
                     tie_word_embeddings=tied)
    extra = ["--dtype", dtype] if dtype else []
    copied: list[str] = []
    copy = ShardedWriter.copy
    monkeypatch.setattr(ShardedWriter, "copy", lambda self, name, stored: (copied.append(name),
                                                                           copy(self, name, stored)))
    assert cli(src, tmp_path / "out", *RANK, *extra).exit_code == 0  # one path: the report and card name it
    with_copies = hashes(tmp_path / "out")
    monkeypatch.setattr(LayerWriter, "_source", _read_and_write)
    assert cli(src, tmp_path / "out", *RANK, *extra, "--force").exit_code == 0
    assert hashes(tmp_path / "out") == with_copies
    assert expected <= set(copied) and not (SCALED - expected) & set(copied)
    assert bool(copied) == bool(expected)


def _read_and_write(self, name, i, key, alpha=1.0):
    self.writer.add(name, scaled(self.weights.tensor(i, key), alpha, self.dtype))


def test_an_error_in_the_outer_tensors_beside_the_layer_threads(tmp_path, monkeypatch):
    """NaN in the head, found while the first layers are factored on their threads: the one-line error, no thread
    left, nothing written."""
    src = make_model(tmp_path / "src", heads=4, kv_heads=2, hidden=32, head_dim=16, layers=4)
    state = load_file(src / "model.safetensors")
    state["lm_head.weight"][1, 2] = float("nan")
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(weights_only, "spare_core", lambda: True)
    monkeypatch.setattr(weights_only, "layer_workers", lambda plan: 2)
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                   "tensor lm_head.weight in model.safetensors contains NaN or Inf")
    assert not [t for t in threading.enumerate() if t.name.startswith(("mlaconv-writer", "mlaconv-layer"))]
