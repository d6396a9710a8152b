"""Writing a checkpoint: sharded safetensors with an index, into a folder that appears atomically.

``atomic_output_dir`` hands out a temporary folder beside OUT and renames it into place only when
the block completes; on any failure (Ctrl-C and SIGTERM included) the temporary folder is removed,
and temporaries left by a killed run are swept at the next run (``atomic_output_file`` does the
same for a single file, a GGUF export). ``ShardedWriter`` streams tensors
into shards of at most ``max_shard_bytes`` and writes ``model.safetensors.index.json``; with ``write_ahead``
it writes on a thread of its own while the caller computes the next tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import torch

from mlaconv.errors import MlaconvError
from mlaconv.io.reader import SAFETENSORS_DTYPES, StoredTensor, cut_short

DEFAULT_SHARD_BYTES = 5 * 10**9
HEADER_RESERVE = 64 * 2**10  # bytes kept for a shard's header: ~400 tensor entries
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
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
    tmp = out.parent / f".{out.name}{_TMP_TAG}{os.getpid()}"
    with _sigterm_as_interrupt():  # before the folder exists, so that no SIGTERM can strand it
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            sweep_stale_temporaries(out)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as exc:
            raise MlaconvError(f"cannot create the output folder {out}: {exc.strerror or exc}") from exc
        try:
            yield tmp
        except OSError as exc:  # a full disk, a vanished file: the environment, not a bug
            shutil.rmtree(tmp, ignore_errors=True)
            raise MlaconvError(f"{exc.strerror or exc}: {exc.filename or out}; nothing was written to {out}") from exc
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


@contextmanager
def atomic_output_file(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``out`` that becomes ``out`` when the block succeeds, and vanishes if not."""
    out = Path(out)
    if out.exists() and not force:
        raise MlaconvError(f"{out} already exists; pass --force to replace it")
    if out.is_dir():
        raise MlaconvError(f"{out} is a folder; give a file name")
    tmp = out.parent / f".{out.name}{_TMP_TAG}{os.getpid()}"
    with _sigterm_as_interrupt():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            for stale in out.parent.glob(f".{out.name}{_TMP_TAG}*"):
                pid_text = stale.name.rsplit("-", 1)[-1]
                if pid_text.isdigit() and (int(pid_text) == os.getpid() or not _pid_alive(int(pid_text))):
                    stale.unlink(missing_ok=True)
        except OSError as exc:
            raise MlaconvError(f"cannot write {out}: {exc.strerror or exc}") from exc
        try:
            yield tmp
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise MlaconvError(f"{exc.strerror or exc}: {exc.filename or out}; nothing was written to {out}") from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, out)


class _WriteAhead:
    """One thread that runs write jobs in order, holding at most ``limit`` bytes of tensors that wait (a
    larger tensor waits alone). The first error is raised in the caller at its next ``submit`` or ``drain``."""

    def __init__(self, limit: int):
        self.limit = limit
        self._jobs: list[tuple[Callable[[], None], int]] = []
        self._waiting = 0  # bytes of the jobs not yet done, the running one included
        self._unfinished = 0  # jobs not yet done, the running one included (a copy holds no bytes)
        self._error: BaseException | None = None
        self._stop = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="mlaconv-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], nbytes: int) -> None:
        with self._changed:
            while self._error is None and self._waiting and self._waiting + nbytes > self.limit:
                self._changed.wait()
            self._raise()
            self._jobs.append((job, nbytes))
            self._waiting += nbytes
            self._unfinished += 1
            self._changed.notify_all()

    def drain(self) -> None:
        """Wait until every job submitted so far is done."""
        with self._changed:
            while self._error is None and self._unfinished:
                self._changed.wait()
            self._raise()

    def stop(self) -> None:
        """Drop the jobs not started, wait for the running one, end the thread."""
        with self._changed:
            self._stop = True
            self._jobs.clear()
            self._changed.notify_all()
        self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._jobs and not self._stop:
                    self._changed.wait()
                if self._stop:
                    return
                job, nbytes = self._jobs.pop(0)
            try:
                job()
            except BaseException as exc:  # handed to the caller
                with self._changed:
                    self._error, self._stop = exc, True
                    self._changed.notify_all()
                return
            del job  # the tensor goes as soon as it is written
            with self._changed:
                self._waiting -= nbytes
                self._unfinished -= 1
                self._changed.notify_all()


class ShardedWriter:
    """Stream tensors into safetensors shards of at most ``max_shard_bytes`` and index them.

    Each tensor goes to disk as it is added, so the writer holds no tensors, whatever the shard size:
    a shard's data is written after ``header_reserve`` bytes kept for its header, which is filled in
    (padded with spaces, as safetensors does) when the shard closes; a header that outgrows the
    reserve moves the shard's data once. Names follow Hugging Face:
    ``model-00001-of-00003.safetensors`` plus ``model.safetensors.index.json`` (even for one shard).

    With ``write_ahead`` > 0 a thread of its own writes the tensors in order while the caller goes on: ``add``
    then keeps the tensor until it is written (the caller must not change it), holding at most ``write_ahead``
    bytes that wait (or one larger tensor). Use it as a context manager: leaving the block on an error stops the
    thread before the caller removes the folder. The output is the same byte for byte either way.
    """

    def __init__(self, folder: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES, header_reserve: int = HEADER_RESERVE,
                 write_ahead: int = 0):
        if max_shard_bytes <= 0:
            raise MlaconvError("the shard size must be positive")
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self.header_reserve = -(-header_reserve // 8) * 8
        self._file: BinaryIO | None = None
        self._entries: dict[str, dict] = {}  # header entries of the open shard, in file order
        self._data_bytes = 0  # data written to the open shard
        self._shards: list[list[str]] = []
        self._names: set[str] = set()
        self._total_bytes = 0
        self._ahead = _WriteAhead(write_ahead) if write_ahead > 0 else None

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        if self._ahead is not None:
            self._ahead.stop()
        if self._file is not None:
            self._file.close()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` to the current shard (now, or in order on the writer's thread with ``write_ahead``)."""
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name} has dtype {tensor.dtype}, which safetensors cannot store")
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()

        def write(file: BinaryIO) -> None:
            file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)

        self._place(name, tensor.dtype, tuple(tensor.shape), size, write, held=size)

    def copy(self, name: str, stored: StoredTensor) -> None:
        """Write a tensor of a source safetensors file as it is, its bytes copied unread: by the kernel from file
        to file (``os.copy_file_range``) where it can, else in blocks. Nothing waits in memory."""
        self._place(name, stored.dtype, stored.shape, stored.nbytes, lambda file: _copy_bytes(stored, name, file),
                    held=0)

    def _place(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], size: int,
               write: Callable[[BinaryIO], None], held: int) -> None:
        """Give ``name`` its place in the current shard (opening the next when it is full) and write it there: now,
        or in order on the writer's thread, ``held`` bytes waiting meanwhile."""
        if name in self._names:
            raise ValueError(f"tensor {name} written twice")
        if self._file is not None and self._entries and self._data_bytes + size > self.max_shard_bytes:
            self._close_shard()
        if self._file is None:
            self._file = open(self._partial(len(self._shards) + 1), "wb")
            self._file.seek(8 + self.header_reserve)
        if size:
            file = self._file
            if self._ahead is None:
                write(file)
            else:
                self._ahead.submit(lambda: write(file), held)
        self._entries[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape),
                               "data_offsets": [self._data_bytes, self._data_bytes + size]}
        self._data_bytes += size
        self._names.add(name)
        self._total_bytes += size

    def _partial(self, number: int) -> Path:
        return self.folder / f"model-{number:05d}.partial.safetensors"

    def _close_shard(self) -> None:
        assert self._file is not None
        if self._ahead is not None:
            self._ahead.drain()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._entries}, separators=(",", ":")).encode()
        if len(header) <= self.header_reserve:
            self._file.seek(0)
            self._file.write(len(header.ljust(self.header_reserve)).to_bytes(8, "little"))
            self._file.write(header.ljust(self.header_reserve))
            self._file.close()
        else:  # the header outgrew its reserve: rewrite the shard with the data moved up
            self._file.close()
            path = self._partial(len(self._shards) + 1)
            moved = path.with_suffix(".moving")
            padded = header.ljust(-(-len(header) // 8) * 8)
            with open(path, "rb") as old, open(moved, "wb") as new:
                new.write(len(padded).to_bytes(8, "little"))
                new.write(padded)
                old.seek(8 + self.header_reserve)
                shutil.copyfileobj(old, new, 64 * 2**20)
            os.replace(moved, path)
        self._shards.append(list(self._entries))
        self._file = None
        self._entries = {}
        self._data_bytes = 0

    def finish(self) -> dict:
        """Close the last shard, give shards their final names, write and return the index."""
        if self._file is not None:
            self._close_shard()
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead = None
        count = len(self._shards)
        weight_map: dict[str, str] = {}
        for number, names in enumerate(self._shards, start=1):
            final = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(self._partial(number), self.folder / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return index


def _copy_bytes(stored: StoredTensor, name: str, file: BinaryIO, block: int = 64 * 2**20) -> None:
    """Append ``stored``'s bytes to ``file`` at its position, without reading them into Python where the kernel can
    copy between the two files; else, or where it copies nothing (some kernels between file systems), in blocks."""
    file.flush()
    at, done = file.tell(), 0
    with open(stored.path, "rb") as source:
        while done < stored.nbytes:
            size = min(block, stored.nbytes - done)
            try:
                count = os.copy_file_range(source.fileno(), file.fileno(), size, stored.offset + done, at + done)
            except (AttributeError, OSError):  # no copy_file_range here, or not between these two file systems
                count = 0
            if not count:
                source.seek(stored.offset + done)
                data = source.read(size)
                if not data:
                    raise cut_short(stored.path, name)
                file.seek(at + done)
                count = file.write(data)
            done += count
    file.seek(at + done)


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
