"""Freed memory kept in glibc's heap for the next tensor, during a weights-only conversion.

glibc maps every allocation above its mmap threshold (32 MiB at most) fresh from the kernel and unmaps it when it is
freed, and gives the top of the heap back as soon as it is free: each large tensor then costs page faults and the
kernel's zeroing. A Llama-3.2-1B-shaped weights-only conversion faulted in 15 GB of pages that way (3.8 M faults,
about 4 of its 27 CPU-seconds in the kernel) to convert 2.5 GB of weights. Inside ``heap_reuse()`` allocations up to
64 MiB (most of a layer's float64 working tensors) come from one heap shared by all threads and stay there when
freed (0.3–0.4 M faults); larger ones (the embedding, a layer's whole q_proj) are still mapped and given back, so
that the heap does not keep them: with 128 MiB the two-thread conversion peaked 0.1–0.2 GB higher. On the way out
the thresholds go to what glibc's own adjustment reaches after a large free, and the heap is trimmed. Elsewhere
than glibc (no ``mallopt``) nothing changes.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from typing import Iterator

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
KEPT_BYTES = 64 * 2**20
_AFTER_MMAP, _AFTER_TRIM = 32 * 2**20, 64 * 2**20  # glibc's dynamic thresholds at their largest


@contextmanager
def heap_reuse() -> Iterator[None]:
    """Allocations up to ``KEPT_BYTES`` from the heap, and freed memory kept there, within the block."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        libc = None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, KEPT_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, KEPT_BYTES)
    libc.mallopt(_M_ARENA_MAX, 1)  # threads share the one heap (and its kept memory) instead of arenas of their own
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _AFTER_MMAP)
        libc.mallopt(_M_TRIM_THRESHOLD, _AFTER_TRIM)
        libc.mallopt(_M_ARENA_MAX, 8 * (os.cpu_count() or 1))  # glibc's default on 64-bit
        libc.malloc_trim(0)
