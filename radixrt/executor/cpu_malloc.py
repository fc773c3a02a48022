"""glibc malloc settings for a CPU engine: keep freed activation memory for reuse.

A CPU forward allocates and frees activations of a few MB each (a 4096-token prefill of the
tiny model: [4096, 512] float32 = 8 MB). glibc serves allocations above its mmap threshold
with fresh `mmap` pages and gives heap tops back to the kernel above its trim threshold, so
every step page-faults its activations in again: ~25-40k minor faults per 32 x (128 in / 32
out) run, 10-20% of its time (benchmarks/bench_cpu_paired.py). Raising both
thresholds (what `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` do) keeps that memory
in the heap: the faults drop to ~0. The cost: the process keeps its peak heap instead of
returning it to the kernel, and that peak creeps up as requests of new shapes (prompt
log-probs: [prompt tokens, vocab] float32 logits) leave holes the next shapes do not fit: a
schema fuzz grew the scheduler by ~120 MiB per 2,500 requests (benchmarks/fuzz_campaign.py).
So `HeapTrim` bounds what is kept: once the RSS has grown KEEP_FREED_BYTES past where the
last trim left it, it gives the free pages back (`malloc_trim`); steps whose activations fit
that bound fault nothing, and a peak of one request's shape stays one step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 30  # allocations below this come from the heap, which is never trimmed
KEEP_FREED_BYTES = 64 << 20  # freed memory kept past the last trim: a few steps' activations
STATM = "/proc/self/statm"


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None off glibc (e.g. musl or macOS)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to THRESHOLD_BYTES, once per process. Returns
    whether it took effect (False off glibc, e.g. musl or macOS: nothing is changed)."""
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES)
    )
    logger.info("glibc malloc: mmap/trim thresholds %d MiB (%s)", THRESHOLD_BYTES >> 20, ok)
    return ok


class HeapTrim:
    """Keeps freed memory between steps (`keep_freed_memory`), at most `keep_bytes` of it:
    after a step that left the process's RSS more than `keep_bytes` above where the last trim
    left it, gives the heap's free pages back to the kernel (`malloc_trim`: every arena, whole
    free pages). Off glibc (or without /proc) both do nothing."""

    def __init__(self, keep_bytes: int = KEEP_FREED_BYTES) -> None:
        assert keep_bytes > 0, keep_bytes
        libc = _libc() if keep_freed_memory() and os.path.exists(STATM) else None
        self._malloc_trim = None if libc is None else libc.malloc_trim
        self.keep_bytes = keep_bytes
        self._page_bytes = os.sysconf("SC_PAGE_SIZE")
        self._floor = 0  # RSS bytes after the last trim (or the lowest since)
        self.num_trims = 0  # malloc_trim calls so far

    def after_step(self) -> None:
        """Trim if the RSS grew more than `keep_bytes` since the last trim (one read of
        /proc/self/statm per step)."""
        if self._malloc_trim is None:
            return
        rss = self._rss_bytes()
        if rss - self._floor > self.keep_bytes:
            self._malloc_trim(0)
            self.num_trims += 1
            self._floor = self._rss_bytes()
        else:
            self._floor = min(self._floor, rss)

    def _rss_bytes(self) -> int:
        with open(STATM, "rb") as f:  # size resident shared text lib data dt, in pages
            return int(f.read().split()[1]) * self._page_bytes
