"""The prefix-cache protocol the scheduler drives.

Ownership rules (all implementations):
- The cache holds its own block references (through the shared `BlockAllocator`);
  requests hold theirs. A block is free when nobody holds it.
- `match` takes no references and changes no reference count; it may split a tree
  node and refresh access times. The caller must `lock(result.handle)` before it
  allocates anything (allocation may evict) and `unlock` it when the request stops
  using the path (finish, abort, preemption, or after moving the lock by `insert`).
- `insert(tokens, blocks)`: `tokens` all have computed KV in `blocks` (the request's
  block table, position p in `blocks[p // block_size]`). The cache takes a reference on
  every block it newly keeps; the caller keeps its own references and releases them
  itself. Returns the handle of the deepest node for `tokens` (lock it, unlock the old).
- `evict(n)` drops unlocked cached entries, least recently used first, until `n` blocks
  became free in the allocator or nothing evictable is left; returns blocks freed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol


class MatchResult(NamedTuple):
    blocks: list[int]  # ceil(num_cached_tokens / block_size) blocks; the last may be partial
    num_cached_tokens: int  # tokens of the query whose KV is cached (token-exact for radix)
    handle: Any  # pass to lock/unlock (radix: deepest matched node; others: opaque)


class InsertResult(NamedTuple):
    handle: Any  # deepest node now covering the inserted tokens
    num_new_tokens: int  # tokens that were not cached before this insert


@dataclass
class CacheStats:
    num_queried_tokens: int = 0  # tokens passed to match
    num_hit_tokens: int = 0  # of those, found cached
    num_evicted_blocks: int = 0  # blocks freed by evict
    num_inserted_tokens: int = 0  # tokens newly cached


class PrefixCache(Protocol):
    block_size: int
    stats: CacheStats

    def match(self, tokens: Sequence[int]) -> MatchResult: ...

    def lock(self, handle: Any) -> None: ...

    def unlock(self, handle: Any) -> None: ...

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> InsertResult: ...

    def evict(self, num_blocks: int) -> int: ...

    @property
    def evictable_blocks(self) -> int:
        """Blocks that `evict` could free now (held by the cache alone, unlocked)."""
        ...

    @property
    def cached_blocks(self) -> int:
        """Distinct blocks the cache holds a reference on."""
        ...

    def held_refs(self) -> Counter[int]:
        """Block -> number of references the cache holds (for integrity checks)."""
        ...

    def check_integrity(self) -> None:
        """Assert the cache's own invariants (structure, lock counts, sizes)."""
        ...

    def reset(self) -> None:
        """Drop every unlocked entry (releasing its references)."""
        ...
