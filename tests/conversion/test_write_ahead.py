"""Weights-only speed (issue 16): the writer's own thread and the layers factored on two threads change no byte,
hold bounded memory, and keep the guarantees of issue 7 (one-line errors, nothing left behind, interrupts)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import MLACONV, RANK, assert_refused, cli, hashes, leftovers, make_model, wait_for_writing
from mlaconv.conversion import weights_only
from mlaconv.io import ShardedWriter
from mlaconv.io.writer import _WriteAhead


def _tensors() -> dict[str, torch.Tensor]:
    tensors = {f"t{i}": torch.randn(3 + i, 5, generator=torch.Generator().manual_seed(i)).to(dtype)
               for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float64] * 3)}
    return tensors | {"empty": torch.zeros(0, 4), "flag": torch.tensor([True, False])}


@pytest.mark.parametrize("reserve", [8, 2**16])
@pytest.mark.parametrize("write_ahead", [1, 100, 2**20])
def test_the_write_ahead_writer_writes_the_same_bytes(tmp_path, reserve, write_ahead):
    """Shards of 200 bytes (closed often, the header moved or not): the same files as writing at once."""
    outputs = {}
    for name, ahead in (("at-once", 0), ("ahead", write_ahead)):
        (tmp_path / name).mkdir()
        with ShardedWriter(tmp_path / name, max_shard_bytes=200, header_reserve=reserve, write_ahead=ahead) as writer:
            for tensor_name, tensor in _tensors().items():
                writer.add(tensor_name, tensor)
            index = writer.finish()
        outputs[name] = hashes(tmp_path / name)
    assert outputs["ahead"] == outputs["at-once"] and len(outputs["ahead"]) > 3
    read = {n: t for shard in (tmp_path / "ahead").glob("*.safetensors") for n, t in load_file(shard).items()}
    assert read.keys() == index["weight_map"].keys() == _tensors().keys()
    assert all(torch.equal(read[n], t) for n, t in _tensors().items())


def test_at_most_the_limit_waits_and_a_larger_tensor_waits_alone():
    ahead = _WriteAhead(limit=100)
    release, done = threading.Event(), []
    ahead.submit(lambda: release.wait(10), 60)  # running, holding 60 bytes
    ahead.submit(lambda: done.append("small"), 40)  # 100 in all: still within the limit
    blocked = threading.Thread(target=ahead.submit, args=(lambda: done.append("large"), 500))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive() and done == []  # 600 bytes would wait: the caller waits instead
    release.set()
    blocked.join(10)
    ahead.drain()
    assert not blocked.is_alive() and done == ["small", "large"]
    ahead.stop()


def test_an_error_on_the_writer_thread_reaches_the_caller_and_stops_the_jobs():
    ahead, done = _WriteAhead(limit=2**20), []

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    ahead.submit(full, 10)
    with pytest.raises(OSError, match="No space left"):
        ahead.drain()
    with pytest.raises(OSError, match="No space left"):
        ahead.submit(lambda: done.append(1), 10)
    ahead.stop()
    assert done == []


def test_a_disk_that_fills_up_on_the_writer_thread(tmp_path, monkeypatch):
    """ENOSPC raised by the writer's thread (not by ``add``): one line, nothing written, no temporary, no thread."""
    src = make_model(tmp_path / "src", heads=4, kv_heads=2, hidden=32, head_dim=16, layers=4)
    submit, jobs = _WriteAhead.submit, []

    def failing(self, job, nbytes):
        jobs.append(job)
        if len(jobs) == 7:
            def job():
                raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out"))
        submit(self, job, nbytes)

    monkeypatch.setattr(_WriteAhead, "submit", failing)
    monkeypatch.setattr(weights_only, "spare_core", lambda: True)  # the writer's thread, whatever torch's threads
    before = hashes(src)
    line = assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "No space left on device")
    assert line.endswith(f"; nothing was written to {tmp_path / 'out'}") and len(jobs) >= 7
    assert not [t for t in threading.enumerate() if t.name.startswith(("mlaconv-writer", "mlaconv-layer"))]


@pytest.mark.parametrize("workers, layers", [(2, 5), (3, 5), (2, 1)])
def test_layers_factored_on_threads_give_the_same_bytes(tmp_path, monkeypatch, workers, layers):
    """The outer tensors are written while the first layers are factored (with fewer layers than threads too)."""
    src = make_model(tmp_path / "src", heads=4, kv_heads=2, hidden=32, head_dim=16, layers=layers, dtype=torch.bfloat16)
    outputs = {}
    for count in (1, workers):
        monkeypatch.setattr(weights_only, "layer_workers", lambda plan, count=count: count)
        assert cli(src, tmp_path / "out", *RANK, "--force").exit_code == 0  # one path: the report names it
        outputs[count] = hashes(tmp_path / "out")
    assert outputs[workers] == outputs[1]


def test_two_layers_at_once_only_with_one_thread_operators_and_a_small_layer(monkeypatch):
    from types import SimpleNamespace

    from mlaconv.mla.layer import AttentionShape

    def plan(hidden, heads, kv_heads, head_dim):
        return SimpleNamespace(shape=AttentionShape(hidden, heads, kv_heads, head_dim))

    monkeypatch.setattr(weights_only, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert weights_only.layer_workers(plan(2048, 32, 8, 64)) == 2  # Llama-3.2-1B
    assert weights_only.layer_workers(plan(8192, 64, 8, 128)) == 1  # Llama-3-70B: 6 GB a layer
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert weights_only.layer_workers(plan(2048, 32, 8, 64)) == 1 and not weights_only.spare_core()


def test_without_a_spare_core_the_conversion_writes_as_before(tmp_path, monkeypatch):
    """Two-thread operators: no writer's thread, no layer threads (they would contend with the operators')."""
    src = make_model(tmp_path / "src", heads=4, kv_heads=2, hidden=32, head_dim=16)
    monkeypatch.setattr(weights_only, "spare_core", lambda: False)
    started = []
    monkeypatch.setattr(_WriteAhead, "__init__", lambda self, limit: started.append(limit))
    assert cli(src, tmp_path / "out", *RANK).exit_code == 0 and started == []


def test_sigterm_while_the_writer_thread_writes_removes_the_temporary_folder(tmp_path):
    """One shard (the default size): the writer's thread is busy when SIGTERM comes."""
    src = make_model(tmp_path / "slow", heads=4, kv_heads=2, hidden=32, head_dim=16, layers=96)
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-c", MLACONV, "convert", str(src), str(out), *RANK],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=os.environ | {"OMP_NUM_THREADS": "1"})  # one-thread operators: the threads run
    temporary = wait_for_writing(process, out)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted: nothing was written to the output" in stderr
    assert not temporary.exists() and not out.exists() and leftovers(out) == []


@pytest.mark.parametrize("cores, omp, fit, inside", [(2, None, True, 1), (2, "2", True, 2), (2, None, False, 2),
                                                      (4, None, True, 2)])
def test_a_weights_only_pass_on_two_cores_runs_one_thread_operators(monkeypatch, cores, omp, fit, inside):
    """As OMP_NUM_THREADS=1 would, unless the user set a thread count, or two layers do not fit at once (a calibrated
    pass, a 7B layer), or there are more cores; torch's setting comes back after the pass, even after an error."""
    monkeypatch.setattr(weights_only, "usable_cores", lambda: cores)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="inside"), weights_only.weights_only_operators(fit):
            assert torch.get_num_threads() == inside
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("layer_memory, seen", [(2**30, (1, 2)), (1, (2, 1))])
@pytest.mark.parametrize("nan", [False, True])
def test_a_cli_conversion_on_two_cores_factors_two_layers_at_once(tmp_path, monkeypatch, layer_memory, seen, nan):
    """Through the CLI, with no thread count set: one-thread operators and two layers at once, torch's two threads
    back afterwards (after a refused conversion too); layers too large for two at once keep torch's threads."""
    src = make_model(tmp_path / "src", heads=4, kv_heads=2, hidden=32, head_dim=16, layers=3)
    if nan:
        state = load_file(src / "model.safetensors")
        state["model.layers.1.self_attn.q_proj.weight"][0, 0] = float("nan")
        save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(weights_only, "usable_cores", lambda: 2)
    monkeypatch.setattr(weights_only, "LAYER_MEMORY", layer_memory)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    calls = []
    workers = weights_only.layer_workers
    monkeypatch.setattr(weights_only, "layer_workers", lambda plan: calls.append((torch.get_num_threads(),
                                                                                  workers(plan))) or calls[-1][1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert (cli(src, tmp_path / "out", *RANK).exit_code != 0) == nan
        assert calls == [seen] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
