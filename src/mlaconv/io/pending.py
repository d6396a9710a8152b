"""Tensors kept on disk until a choice is made: several versions of one layer's tensors, one file per layer.

The calibrated conversion writes a refined layer's attention both ways (closed form and refined) here, and
the chosen version into the checkpoint once the whole-model check has compared the two; memory holds one
layer's tensors at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class PendingTensors:
    """``put(key, versions)`` stores named versions of a dict of tensors; ``take(key, version)`` reads one back
    (tensor by tensor) and deletes the file."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.keys: list[int] = []

    def _path(self, key: int) -> Path:
        return self.folder / f"pending-{key:05d}.safetensors"

    def put(self, key: int, versions: dict[str, dict[str, torch.Tensor]]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        save_file({f"{version}/{name}": tensor.contiguous() for version, tensors in versions.items()
                   for name, tensor in tensors.items()}, str(self._path(key)))
        self.keys.append(key)

    def take(self, key: int, version: str) -> dict[str, torch.Tensor]:
        path = self._path(key)
        with safe_open(str(path), framework="pt") as handle:
            tensors = {name.split("/", 1)[1]: handle.get_tensor(name) for name in handle.keys()
                       if name.split("/", 1)[0] == version}
        path.unlink()
        self.keys.remove(key)
        if not self.keys and self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()
        return tensors
