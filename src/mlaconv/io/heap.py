"""glibc's heap during a weights-only conversion: one heap for all threads, freed memory kept for the next tensor.

By default glibc starts mapping every allocation above 128 KiB fresh from the kernel (raising that threshold, up to
32 MiB, only as such blocks are freed), unmaps it when it is freed and gives the top of the heap back as soon as it
is free; and each thread that allocates gets an arena of its own, which keeps what it freed. For a
Llama-3.2-1B-shaped weights-only conversion that meant 3.8 M page faults (15 GB of pages faulted in and zeroed by
the kernel, about 4 of its 27 CPU-seconds) to convert 2.5 GB of weights, and, once two layers were factored on
threads of their own, a peak of 2.2 GB from the threads' arenas. Inside ``heap_reuse()`` the thresholds start where
glibc's own adjustment ends (32 MiB), so smaller blocks come from the heap and stay there, and every thread
allocates from the one heap: 2.4 M faults, peak 1.20–1.25 GB. Keeping blocks up to 64 MiB (a layer's float64
matrices) in the heap too took 0.7–1.2 M faults but peaked at 1.29–1.51 GB: the two threads' blocks interleave
and the heap fragments. On the way out the defaults come back as far as ``mallopt`` allows, and the heap is
trimmed. Elsewhere than glibc (no ``mallopt``) nothing changes.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from typing import Iterator

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
KEPT_BYTES = 32 * 2**20
_AFTER_MMAP, _AFTER_TRIM = 32 * 2**20, 64 * 2**20  # glibc's dynamic thresholds at their largest


@contextmanager
def heap_reuse() -> Iterator[None]:
    """Allocations up to ``KEPT_BYTES`` from the one heap, and freed memory kept there, within the block."""
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
