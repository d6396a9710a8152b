"""The dtypes and devices mlaconv computes in: the ``--dtype`` choices, where calibration runs unless told, a
``--device`` checked, and the memory the machine has free."""

from __future__ import annotations

import torch

from mlaconv.errors import MlaconvError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --dtype choices


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (or a conservative 8 GiB where that file does not exist)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def free_memory_bytes(device: str | None) -> int:
    """What ``device`` has free: the GPU's free memory for a CUDA device torch sees, else the machine's available
    memory."""
    if device and torch.device(device).type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(torch.device(device))[0]
    return available_memory_bytes()


def computes_bfloat16(device: str) -> bool:
    """Whether ``device`` multiplies in bfloat16 natively: a CUDA GPU that supports it, or a CPU with AVX512-BF16 or
    AMX. Elsewhere torch emulates bfloat16, slower than float32."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        checks = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
        return any(check is not None and check() for check in checks)
    return False


def computing(device: torch.device, precision: str | None):
    """The context a forward pass runs in at ``precision``: bfloat16 autocast (the weights stay as they are), or none
    for float32 (and None)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16")


def default_device() -> str:
    """Where calibration runs unless told: the GPU when torch sees one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None, option: str = "--device") -> None:
    """Refuse, in one line, a device torch cannot use here (an unknown name, or CUDA without a GPU)."""
    if not device:
        return
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise MlaconvError(f"unknown {option} {device!r} (try cpu, cuda, cuda:1, mps)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise MlaconvError(f"{option} {device}: torch sees no CUDA device here")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise MlaconvError(f"{option} {device}: torch sees no MPS device here")
