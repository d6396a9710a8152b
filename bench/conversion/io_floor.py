#!/usr/bin/env python
"""The floor of any Python tool for a conversion's I/O (issue 16): read every tensor of a safetensors checkpoint with
safetensors, and write shards of given data sizes with ``safetensors.torch.save_file``.

    python -m bench.conversion.io_floor SRC OUT SIZES      # SIZES: each shard's data bytes, comma-separated

``bench.conversion.memory`` runs it in turn with each convert trial, with the converted output's shard sizes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def shard_data_bytes(folder: Path) -> list[int]:
    """The data bytes of each safetensors shard in ``folder``, from the headers alone (no torch here)."""
    sizes = []
    for shard in sorted(folder.glob("*.safetensors")):
        with open(shard, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        sizes.append(max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0))
    return sizes


def floor_copy(source: Path, out: Path, shard_bytes: list[int]) -> None:
    """(In a child process.) Read every tensor of ``source`` with ``safe_open``, and write shards holding
    ``shard_bytes`` bytes of data each with ``save_file``, one shard in memory at a time: the source tensors in
    file order (the last one of a shard cut to fit, its rest starting the next), then zeros where the output is
    larger than the source."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    def source_bytes():
        for file in sorted(source.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield handle.get_tensor(name).reshape(-1).view(torch.uint8)
        while True:
            yield torch.zeros(2**28, dtype=torch.uint8)

    stream, rest = source_bytes(), torch.empty(0, dtype=torch.uint8)
    out.mkdir(parents=True)
    for number, size in enumerate(shard_bytes, start=1):
        parts, held = [], 0
        while held < size:
            if not rest.numel():
                rest = next(stream)
            take = min(size - held, rest.numel())
            parts.append(rest[:take].clone() if take < rest.numel() else rest)
            rest, held = rest[take:], held + take
        save_file({f"t{i}": part for i, part in enumerate(parts)}, str(out / f"model-{number:05d}.safetensors"))
        del parts


if __name__ == "__main__":
    floor_copy(Path(sys.argv[1]), Path(sys.argv[2]), [int(n) for n in sys.argv[3].split(",")])
