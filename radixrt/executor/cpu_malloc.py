"""glibc malloc settings for a CPU engine: keep freed activation memory for reuse.

A CPU forward allocates and frees activations of a few MB each (a 4096-token prefill of the
tiny model: [4096, 512] float32 = 8 MB). glibc serves allocations above its mmap threshold
with fresh `mmap` pages and gives heap tops back to the kernel above its trim threshold, so
every step page-faults its activations in again: ~25-40k minor faults per 32 x (128 in / 32
out) run, 10-20% of its time (benchmarks/bench_cpu_paired.py). Raising both
thresholds (what `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` do) keeps that memory
in the heap: the faults drop to ~0. The cost: the process keeps its peak heap instead of
returning it to the kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 30  # allocations below this come from the heap, which is never trimmed


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to THRESHOLD_BYTES, once per process. Returns
    whether it took effect (False off glibc, e.g. musl or macOS: nothing is changed)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES)
    )
    logger.info("glibc malloc: mmap/trim thresholds %d MiB (%s)", THRESHOLD_BYTES >> 20, ok)
    return ok
