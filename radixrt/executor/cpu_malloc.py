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
So `HeapTrim` gives the free pages back every TRIM_EVERY_STEPS steps (`malloc_trim`): the
kept memory is bounded by what those steps use, and the faults come back once per interval.
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
TRIM_EVERY_STEPS = 64  # steps between two malloc_trim calls: one step's faults per interval


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
    """Keeps freed memory between steps (`keep_freed_memory`) and gives the heap's free pages
    back to the kernel every `every_steps` steps. Off glibc both do nothing."""

    def __init__(self, every_steps: int = TRIM_EVERY_STEPS) -> None:
        assert every_steps >= 1, every_steps
        libc = _libc() if keep_freed_memory() else None
        self._malloc_trim = None if libc is None else libc.malloc_trim
        self.every_steps = every_steps
        self._steps = 0
        self.num_trims = 0  # malloc_trim calls so far

    def after_step(self) -> None:
        """Count a step; on every `every_steps`-th, trim (all arenas, whole free pages)."""
        if self._malloc_trim is None:
            return
        self._steps += 1
        if self._steps % self.every_steps == 0:
            self._malloc_trim(0)
            self.num_trims += 1
