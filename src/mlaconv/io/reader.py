"""Finding a source checkpoint and reading its tensors lazily, one at a time.

A source is a local folder or a Hugging Face hub id resolved through the local cache (so it works
offline). Tensors come from safetensors files (single or sharded with an index), read one at a time
at the offsets their headers give; ``.bin`` checkpoints load only with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from mlaconv.errors import MlaconvError, MlaconvWarning

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")

_MAX_HEADER_BYTES = 100_000_000  # the safetensors limit
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def resolve_source(source: str, revision: str | None = None) -> Path:
    """Return the local folder that holds ``source``: a path, or a hub id found in the HF cache.

    A hub id is looked up in the local cache first; it is downloaded only when it is not cached and
    the hub is not switched off (``HF_HUB_OFFLINE=1``).
    """
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise MlaconvError(f"{source} is a file; give the folder that holds config.json and the weights")
        return path
    if not _HUB_ID.match(source) or source.count("/") > 1:
        raise MlaconvError(f"no such folder: {source}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import HfHubHTTPError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]
    ignore = ["consolidated*"]  # Mistral's second copy of the weights, in its own naming
    cached = None
    try:
        cached = Path(snapshot_download(source, revision=revision, local_files_only=True, allow_patterns=patterns,
                                        ignore_patterns=ignore))
    except LocalEntryNotFoundError:
        pass
    if cached is not None and _has_weights(cached):
        return cached
    if _hub_offline():
        where = "only partly in the local Hugging Face cache (config but not all weights)" if cached else (
            "neither a local folder nor in the local Hugging Face cache")
        raise MlaconvError(f"{source} is {where} and offline mode is on") from None
    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=patterns, ignore_patterns=ignore))
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise MlaconvError(f"{source} is not a local folder and could not be fetched from the hub: {exc}") from None


def _has_weights(folder: Path) -> bool:
    """Whether a cached snapshot holds complete weights, looked for in the reader's order (``_index_weights``)."""
    if (folder / SAFETENSORS_INDEX).is_file():
        return _index_complete(folder / SAFETENSORS_INDEX)
    if _weight_files(folder):
        return True
    if (folder / BIN_INDEX).is_file():
        return _index_complete(folder / BIN_INDEX)
    return (folder / "pytorch_model.bin").is_file()


def _index_complete(index: Path) -> bool:
    try:
        files = set(json.loads(index.read_text())["weight_map"].values())
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        return True  # present but malformed: let the reader name the problem
    return all(isinstance(f, str) and (index.parent / f).is_file() for f in files)


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of an unindexed folder (``consolidated*`` is another layout of the same weights)."""
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated"))


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes", "on"}


def read_config(folder: Path) -> dict:
    """The parsed ``config.json`` of a checkpoint folder."""
    path = folder / "config.json"
    if not path.is_file():
        raise MlaconvError(f"{folder} is not a model folder: it has no config.json")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MlaconvError(f"{path} is not valid JSON: {exc}") from None


class CheckpointReader:
    """Lazy, read-only access to the tensors of a checkpoint folder.

    Only the tensor asked for is read, with plain file reads at the offsets of the safetensors
    header (so a large shard adds nothing to the resident memory but the tensor), or, for a tensor
    copied unread (``stored``), mapped from the file only for its check.
    Shapes and dtypes come from the headers alone, which are checked against each file's size.
    Every floating-point tensor read or copied is checked for NaN and Inf.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.format, self._file_of = _index_weights(self.folder)
        self._entries: dict[str, StoredTensor] = {}
        self._bin_state: dict[str, torch.Tensor] | None = None
        self._bin_path: Path | None = None
        if self.format == "safetensors":
            for path in sorted(set(self._file_of.values())):
                for name, entry in read_safetensors_header(path).items():
                    if self._file_of.get(name) == path:
                        self._entries[name] = entry
            missing = set(self._file_of) - set(self._entries)
            if missing:
                name = sorted(missing)[0]
                raise MlaconvError(f"the index lists {name} in {self._file_of[name].name}, but that file lacks it")
        else:
            warnings.warn(MlaconvWarning(
                f"{self.folder} holds pickle weights (.bin): loading them with torch.load(weights_only=True), which "
                "refuses anything but tensors; prefer safetensors"), stacklevel=2)

    @property
    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        if self.format == "safetensors":
            return self._entries[self._known(name)].shape
        return tuple(self._bin_tensor(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        if self.format == "safetensors":
            return self._entries[self._known(name)].dtype
        return self._bin_tensor(name).dtype

    def nbytes(self) -> int:
        """Total bytes of all tensors, from the headers."""
        return sum(math.prod(self.shape(name)) * _element_size(self.dtype(name)) for name in self._file_of)

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into memory (a fresh CPU tensor the caller owns)."""
        if self.format == "safetensors":
            tensor = _read_tensor(self._entries[self._known(name)], name)
        else:
            tensor = self._bin_tensor(name).clone()
        if _checked(tensor.dtype) and not _all_finite(tensor):
            raise MlaconvError(_non_finite(name, self._file_of[name]))
        return tensor

    def stored(self, name: str) -> StoredTensor | None:
        """Where tensor ``name`` lies in its safetensors file, for copying its bytes unread
        (``ShardedWriter.copy``); checked for NaN and Inf through a mapping of the file, so nothing is copied into
        memory. None for a pickle checkpoint."""
        if self.format != "safetensors":
            return None
        entry = self._entries[self._known(name)]
        if _checked(entry.dtype) and not _mapped_finite(entry, name):
            raise MlaconvError(_non_finite(name, entry.path))
        return entry

    def close(self) -> None:
        self._bin_state = None
        self._bin_path = None

    def _known(self, name: str) -> str:
        if name not in self._file_of:
            raise MlaconvError(f"the checkpoint in {self.folder} has no tensor {name}")
        return name

    def _bin_tensor(self, name: str) -> torch.Tensor:
        """A tensor of a pickle checkpoint, still backed by its memory-mapped file."""
        path = self._file_of[self._known(name)]
        if self._bin_path != path:
            self._bin_state = _load_bin(path)
            self._bin_path = path
        assert self._bin_state is not None
        if name not in self._bin_state:
            raise MlaconvError(f"the index lists {name} in {path.name}, but that file lacks it")
        return self._bin_state[name]


def _checked(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` are checked for NaN and Inf (8-bit floats are left as they are)."""
    return dtype.is_floating_point and _element_size(dtype) > 1


def cut_short(path: Path, name: str) -> MlaconvError:
    return MlaconvError(f"{path} ended inside tensor {name} (was it truncated while mlaconv ran?)")


def _non_finite(name: str, path: Path) -> str:
    return (f"tensor {name} in {path.name} contains NaN or Inf; the checkpoint is damaged (download it again, or "
            "fix the training run that wrote it)")


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lives in a safetensors file."""

    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # from the start of the file
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file, from its header, checked against the file's size."""

    def corrupt(why: str) -> MlaconvError:
        return MlaconvError(f"{path} is not a readable safetensors file: {why}; download or copy it again")

    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise corrupt(f"it has only {size} bytes")
        length = int.from_bytes(prefix, "little")
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise corrupt(f"its header claims {length} bytes and the file has {size} (truncated?)")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise corrupt("its header is not JSON") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    header.pop("__metadata__", None)
    entries: dict[str, StoredTensor] = {}
    data_end = 0
    for name, info in header.items():
        try:
            dtype_name = info["dtype"]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"the header entry of {name} is malformed") from None
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise MlaconvError(f"{path.name}: tensor {name} has unsupported dtype {dtype_name}")
        if begin < 0 or min(shape, default=0) < 0 or end - begin != math.prod(shape) * _element_size(dtype):
            raise corrupt(f"the offsets of {name} do not match its shape")
        entries[name] = StoredTensor(path, shape, dtype, 8 + length + begin, end - begin)
        data_end = max(data_end, end)
    if 8 + length + data_end > size:
        raise corrupt(f"it is truncated ({size} bytes; its header describes {8 + length + data_end})")
    return entries


def _read_tensor(entry: StoredTensor, name: str) -> torch.Tensor:
    """One tensor read straight into an uninitialised buffer (no zero fill, no copy)."""
    data = torch.empty(entry.nbytes, dtype=torch.uint8)
    view, done = memoryview(data.numpy()), 0
    with open(entry.path, "rb", buffering=0) as handle:
        handle.seek(entry.offset)
        while done < entry.nbytes:  # one read returns at most ~2 GiB on Linux
            count = handle.readinto(view[done:])
            if not count:
                raise cut_short(entry.path, name)
            done += count
    return data.view(entry.dtype).reshape(entry.shape)


def _mapped_finite(entry: StoredTensor, name: str) -> bool:
    """``_all_finite`` of a tensor seen through a copy-on-write mapping of its file: the page cache's own pages,
    no copy (nothing writes to them)."""
    if not entry.nbytes:
        return True
    start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY
    with open(entry.path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size < entry.offset + entry.nbytes:  # mapped past the end: SIGBUS, not an error
            raise cut_short(entry.path, name)
        mapped = mmap.mmap(handle.fileno(), entry.offset + entry.nbytes - start, access=mmap.ACCESS_COPY,
                           offset=start)
    with mapped:
        tensor = torch.frombuffer(mapped, dtype=entry.dtype, count=entry.nbytes // _element_size(entry.dtype),
                                  offset=entry.offset - start)
        try:
            return _all_finite(tensor)
        finally:
            del tensor  # before the mapping closes


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf: min and max in one reduction (NaN propagates to both), no mask as large as the tensor."""
    if not tensor.numel():
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def _index_weights(folder: Path) -> tuple[str, dict[str, Path]]:
    """Map every tensor name to the file that holds it; prefer safetensors over ``.bin``."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        return "safetensors", _read_index(index)
    files = _weight_files(folder)
    if files:
        return "safetensors", {name: path for path in files for name in read_safetensors_header(path)}
    bin_index = folder / BIN_INDEX
    if bin_index.is_file():
        return "bin", _read_index(bin_index)
    single_bin = folder / "pytorch_model.bin"
    if single_bin.is_file():
        return "bin", {name: single_bin for name in _load_bin(single_bin)}
    raise MlaconvError(f"{folder} holds no weights (no *.safetensors, no pytorch_model.bin)")


def _read_index(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise MlaconvError(f"{index.name} is not a valid weight index: {exc}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise MlaconvError(f"{index.name} is not a valid weight index: weight_map must map names to file names")
    mapping = {name: index.parent / file for name, file in weight_map.items()}
    for path in sorted(set(mapping.values())):
        if not path.is_file():
            raise MlaconvError(f"{index.name} names {path.name}, which is missing")
    return mapping


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A pickle state dict, loaded memory-mapped with ``weights_only=True`` (no code runs)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        called = re.search(r"GLOBAL ([\w.]+)", str(exc))
        raise MlaconvError(
            f"{path.name} is refused: it is a pickle that holds more than tensors"
            f"{f' (it would call {called.group(1)})' if called else ''}; mlaconv loads .bin files only with "
            "torch.load(weights_only=True), so nothing in them runs — get a safetensors copy from a source you trust"
        ) from None
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise MlaconvError(f"{path.name} cannot be loaded (truncated or corrupt?): {first_line}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise MlaconvError(f"{path.name} is not a state dict of tensors")
    return state
