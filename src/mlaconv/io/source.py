"""Finding a source checkpoint and reading its tensors lazily, one at a time.

A source is a local folder or a Hugging Face hub id resolved through the local cache (so it works
offline). Tensors come from safetensors files (single or sharded with an index) opened memory-mapped,
at most one shard open at a time; ``.bin`` checkpoints load only with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from mlaconv.errors import MlaconvError

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")

_SAFETENSORS_DTYPES = {
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
    try:
        return Path(snapshot_download(source, revision=revision, local_files_only=True, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        pass
    if _hub_offline():
        raise MlaconvError(
            f"{source} is neither a local folder nor in the local Hugging Face cache (offline mode is on)"
        ) from None
    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=patterns))
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise MlaconvError(f"{source} is not a local folder and could not be fetched from the hub: {exc}") from None


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

    Only the tensor asked for is read; at most one safetensors shard is open at a time (opening is
    a memory map, so switching shards is cheap). Shapes and dtypes come from the headers alone.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.format, self._file_of = _index_weights(self.folder)
        self._open_path: Path | None = None
        self._open_handle = None
        self._bin_state: dict[str, torch.Tensor] | None = None
        self._bin_path: Path | None = None
        self._headers: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        if self.format == "safetensors":
            for path in sorted(set(self._file_of.values())):
                handle = self._open(path)
                for name in handle.keys():
                    if self._file_of.get(name) == path:
                        sl = handle.get_slice(name)
                        dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                        if dtype is None:
                            raise MlaconvError(f"{path.name}: tensor {name} has unsupported dtype {sl.get_dtype()}")
                        self._headers[name] = (tuple(sl.get_shape()), dtype)
            missing = set(self._file_of) - set(self._headers)
            if missing:
                name = sorted(missing)[0]
                raise MlaconvError(f"the index lists {name} in {self._file_of[name].name}, but that file lacks it")

    @property
    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        if self.format == "safetensors":
            return self._headers[self._known(name)][0]
        return tuple(self.get(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        if self.format == "safetensors":
            return self._headers[self._known(name)][1]
        return self.get(name).dtype

    def nbytes(self) -> int:
        """Total bytes of all tensors, from the headers."""
        total = 0
        for name in self._file_of:
            shape, dtype = (self._headers[name] if self.format == "safetensors" else (self.shape(name), self.dtype(name)))
            n = 1
            for s in shape:
                n *= s
            total += n * torch.empty((), dtype=dtype).element_size()
        return total

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into memory (a fresh CPU tensor the caller owns)."""
        path = self._file_of[self._known(name)]
        if self.format == "safetensors":
            try:
                return self._open(path).get_tensor(name).clone()
            except Exception as exc:  # safetensors raises its own error types for bad data
                raise MlaconvError(f"{path.name}: cannot read tensor {name}: {exc}") from None
        if self._bin_path != path:
            self._bin_state = _load_bin(path)
            self._bin_path = path
        assert self._bin_state is not None
        if name not in self._bin_state:
            raise MlaconvError(f"the index lists {name} in {path.name}, but that file lacks it")
        return self._bin_state[name].clone()

    def close(self) -> None:
        self._open_handle = None
        self._open_path = None
        self._bin_state = None
        self._bin_path = None

    def _known(self, name: str) -> str:
        if name not in self._file_of:
            raise MlaconvError(f"the checkpoint in {self.folder} has no tensor {name}")
        return name

    def _open(self, path: Path):
        if self._open_path != path:
            self._open_handle = None
            try:
                self._open_handle = safe_open(str(path), framework="pt")
            except Exception as exc:
                raise MlaconvError(f"{path.name} is not a readable safetensors file (truncated or corrupt?): {exc}") from None
            self._open_path = path
        return self._open_handle


def _index_weights(folder: Path) -> tuple[str, dict[str, Path]]:
    """Map every tensor name to the file that holds it; prefer safetensors over ``.bin``."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        return "safetensors", _read_index(index)
    single = folder / "model.safetensors"
    files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if files:
        mapping: dict[str, Path] = {}
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():
                        mapping[name] = path
            except Exception as exc:
                raise MlaconvError(f"{path.name} is not a readable safetensors file (truncated or corrupt?): {exc}") from None
        return "safetensors", mapping
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
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise MlaconvError(f"{index.name} is not a valid weight index: {exc}") from None
    mapping = {name: index.parent / file for name, file in weight_map.items()}
    for path in sorted(set(mapping.values())):
        if not path.is_file():
            raise MlaconvError(f"{index.name} names {path.name}, which is missing")
    return mapping


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    warnings.warn(
        f"{path.name} is a pickle checkpoint: loading it with torch.load(weights_only=True); prefer safetensors",
        stacklevel=3,
    )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise MlaconvError(f"{path.name} cannot be loaded safely (weights_only=True refused it or it is corrupt): {exc}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise MlaconvError(f"{path.name} is not a state dict of tensors")
    return state
