"""Reference-counted allocator of KV blocks.

A block is free exactly when its reference count is zero. Holders are requests
(one reference per block of their block table) and prefix-cache entries (one
reference per block a cache node or hash entry keeps). Nothing here touches the
KV tensors; the allocator hands out block ids into `KVPool`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class OutOfBlocks(RuntimeError):
    """Raised by `allocate` when fewer blocks are free than asked for."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Stack of free ids; low ids come out first (pop from the end).
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, each with reference count 1. Raises OutOfBlocks."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        if n == 0:
            return []
        blocks = self._free[-n:]
        del self._free[-n:]
        blocks.reverse()
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (each must be in use)."""
        for b in blocks:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def decref(self, blocks: Iterable[int]) -> int:
        """Drop one reference from each block; returns how many became free."""
        freed = 0
        for b in blocks:
            rc = self.ref_counts[b]
            assert rc > 0, f"decref of free block {b}"
            self.ref_counts[b] = rc - 1
            if rc == 1:
                self._free.append(b)
                freed += 1
        return freed

    def check_integrity(self, expected_refs: Counter[int] | None = None) -> None:
        """Assert free list and reference counts agree.

        `expected_refs` (block -> number of holders), when given, must equal the
        reference counts exactly: every holder is accounted for, nothing leaks.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "block on the free list twice"
        for b in range(self.num_blocks):
            rc = self.ref_counts[b]
            assert rc >= 0
            assert (rc == 0) == (b in free), f"block {b}: ref {rc}, on free list {b in free}"
            if expected_refs is not None:
                assert rc == expected_refs.get(b, 0), (
                    f"block {b}: ref count {rc} but {expected_refs.get(b, 0)} holders"
                )
