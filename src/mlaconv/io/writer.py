"""Writing a checkpoint: sharded safetensors with an index, into a folder that appears atomically.

``atomic_output_dir`` hands out a temporary folder beside OUT and renames it into place only when
the block completes; on any failure (Ctrl-C and SIGTERM included) the temporary folder is removed,
and temporaries left by a killed run are swept at the next run. ``ShardedWriter`` streams tensors
into shards of at most ``max_shard_bytes`` and writes ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from mlaconv.errors import MlaconvError

DEFAULT_SHARD_BYTES = 5 * 10**9
_TMP_TAG = ".mlaconv-tmp-"
_OLD_TAG = ".mlaconv-old-"


def check_output_target(out: Path, source: Path, force: bool) -> None:
    """Refuse an OUT that would overwrite without ``--force``, or that overlaps the source folder."""
    out_r, src_r = out.resolve(), source.resolve()
    if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
        raise MlaconvError(f"the output {out} overlaps the source folder {source}; choose a separate folder")
    if out.exists() and not force:
        raise MlaconvError(f"{out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise MlaconvError(f"{out} exists and is not a folder")


def check_free_space(folder: Path, needed_bytes: int) -> None:
    """Fail before writing if the disk under ``folder`` cannot hold ``needed_bytes`` (plus 2% slack)."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes * 1.02 + 16 * 2**20:
        raise MlaconvError(
            f"not enough free disk space under {probe}: need about {needed_bytes / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} GiB free"
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_temporaries(out: Path) -> None:
    """Remove temporary folders for ``out`` left behind by runs that were killed."""
    for tag in (_TMP_TAG, _OLD_TAG):
        for stale in out.parent.glob(f".{out.name}{tag}*"):
            pid_text = stale.name.rsplit("-", 1)[-1]
            if pid_text.isdigit() and int(pid_text) != os.getpid() and not _pid_alive(int(pid_text)):
                shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Make SIGTERM unwind like Ctrl-C so cleanup runs (only possible in the main thread)."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt


@contextmanager
def atomic_output_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder that becomes ``out`` when the block succeeds, and vanishes if not."""
    out = Path(out)
    if out.exists() and not force:
        raise MlaconvError(f"{out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_temporaries(out)
    tmp = out.parent / f".{out.name}{_TMP_TAG}{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with _sigterm_as_interrupt():
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if out.exists():
            old = out.parent / f".{out.name}{_OLD_TAG}{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)


class ShardedWriter:
    """Stream tensors into safetensors shards of at most ``max_shard_bytes`` and index them.

    Shards are written as soon as they fill, so at most one shard's worth of tensors is held.
    Names follow Hugging Face: ``model-00001-of-00003.safetensors`` plus
    ``model.safetensors.index.json`` (written even for a single shard).
    """

    def __init__(self, folder: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        if max_shard_bytes <= 0:
            raise MlaconvError("the shard size must be positive")
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in shard for shard in self._shards):
            raise ValueError(f"tensor {name} written twice")
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += size
        self._total_bytes += size

    def _flush(self) -> None:
        if not self._pending:
            return
        number = len(self._shards) + 1
        save_file(self._pending, str(self.folder / f"model-{number:05d}.partial.safetensors"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending = {}
        self._pending_bytes = 0

    def finish(self) -> dict:
        """Write the last shard, give shards their final names, write and return the index."""
        self._flush()
        count = len(self._shards)
        weight_map: dict[str, str] = {}
        for number, names in enumerate(self._shards, start=1):
            final = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / f"model-{number:05d}.partial.safetensors", self.folder / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return index


def parse_size(text: str) -> int:
    """Parse a size such as ``5GB``, ``500MB``, ``2GiB`` or a plain byte count."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    cleaned = text.strip().upper().replace(" ", "")
    number = cleaned.rstrip("KMGTIB")
    unit = cleaned[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise MlaconvError(f"cannot read the size {text!r} (try 5GB or 500MB)") from None
    if unit not in units or value <= 0:
        raise MlaconvError(f"cannot read the size {text!r} (try 5GB or 500MB)")
    return int(value * units[unit])
