"""The prefix-cache protocol the scheduler drives.

Ownership rules (all implementations):
- The cache holds its own block references (through the shared `BlockAllocator`);
  requests hold theirs. A block is free when nobody holds it.
- `match` takes no references for the caller and refreshes access times. The radix tree
  may split a node so the handle ends exactly at the match; when the cut falls inside a
  block, both halves record that block, so the cache's own reference count on it goes up
  by one (`held_refs` shows it). No other reference count changes. The caller must
  `lock(result.handle)` before it allocates anything (allocation may evict) and `unlock`
  it when the request stops using the path (finish, abort, preemption, or after moving
  the lock by `insert`). `match` counts nothing in `stats`: the scheduler records one
  lookup per admitted prompt (`CacheStats.record_lookup`).
- `insert(tokens, blocks)`: `tokens` all have computed KV in `blocks` (the request's
  block table, position p in `blocks[p // block_size]`). The cache takes a reference on
  every block it newly keeps; the caller keeps its own references and releases them
  itself. Returns the handle of the deepest node for `tokens` (lock it, unlock the old).
- `evict(n)` drops unlocked cached entries, least recently used first, until `n` blocks
  became free in the allocator or nothing evictable is left; returns blocks freed.
- Host tier (radix only): `match` may end in host-resident nodes (`num_host_tokens > 0`);
  after `lock(handle)`, `load(handle)` allocates device blocks for them (it may evict), queues
  SwapIn ops and returns the full device block table (None when blocks are short).
  `take_swap_ops()` hands the queued SwapIn / SwapOut ops to the scheduler for the next plan.
- `namespace` (tenants; `radixrt.cache.namespace.CacheNamespace`): `match` and `insert` take
  the request's namespace (default: the shared, unsalted one); entries inserted in one are
  never matched in another (radix: one root per namespace; blockhash: the namespace seeds the
  hash chain).
- `priority` (`insert`): the inserting request's priority; the radix tree evicts entries of
  the least urgent priority (the highest number) first, LRU within one (others ignore it).
- `version` increases whenever an entry is removed (evict, reset): a MatchResult taken
  before may name freed blocks and must be matched again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace

if TYPE_CHECKING:
    from radixrt.cache.tiers import KVTier
    from radixrt.plan import SwapIn, SwapOut


class MatchResult(NamedTuple):
    blocks: list[int]  # ceil((num_cached_tokens - num_host_tokens) / block_size) device
    # blocks; the last may be partial
    num_cached_tokens: int  # tokens of the query whose KV is cached (token-exact for radix)
    handle: Any  # pass to lock/unlock (radix: deepest matched node; others: opaque)
    num_host_tokens: int = 0  # of num_cached_tokens, the trailing ones whose KV is only in
    # the host tier: lock the handle, then `load(handle)` gives the whole device table


class InsertResult(NamedTuple):
    handle: Any  # deepest node now covering the inserted tokens
    num_new_tokens: int  # tokens that were not cached before this insert


@dataclass
class CacheStats:
    num_queried_tokens: int = 0  # prompt tokens of admitted requests (once per request)
    num_hit_tokens: int = 0  # of those, served from the cache
    num_evicted_blocks: int = 0  # blocks freed by evict
    num_inserted_tokens: int = 0  # tokens newly cached

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """One admitted prompt of `num_queried` tokens, `num_hit` of them cached."""
        self.num_queried_tokens += num_queried
        self.num_hit_tokens += num_hit


class PrefixCache(Protocol):
    mode: str  # CacheConfig.prefix_cache: "radix" | "blockhash" | "none"
    block_size: int
    stats: CacheStats
    version: int  # bumped whenever an entry is removed (see the module docstring)
    host: KVTier | None  # the host KV tier (radix only; None: no host tier)

    def match(
        self, tokens: Sequence[int], namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> MatchResult: ...

    def lock(self, handle: Any) -> None: ...

    def unlock(self, handle: Any) -> None: ...

    def insert(
        self,
        tokens: Sequence[int],
        blocks: Sequence[int],
        namespace: CacheNamespace = DEFAULT_NAMESPACE,
        priority: int = 0,
    ) -> InsertResult: ...

    def evict(self, num_blocks: int) -> int: ...

    def locked_blocks(self, handle: Any) -> list[int]:
        """The distinct device blocks `lock(handle)` keeps from eviction (radix: every block
        a node of the path root..handle records, including a parent's partial block where a
        deeper node diverged inside it; a match's `blocks` may leave that one out)."""
        ...

    def prefix_boundaries(self, handle: Any) -> list[int]:
        """Lengths (> 0) at which shorter cached prefixes of the match `handle` end, ascending
        (radix: where the path's nodes begin); [] when only the empty prefix is shorter."""
        ...

    @property
    def evictable_blocks(self) -> int:
        """Blocks that `evict` could free now (held by the cache alone, unlocked)."""
        ...

    @property
    def cached_blocks(self) -> int:
        """Distinct blocks the cache holds a reference on."""
        ...

    @property
    def host_cached_blocks(self) -> int:
        """Distinct host blocks the cache holds a reference on (0 without a host tier)."""
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

    def flush_salts(self, salts: Callable[[str | None], bool]) -> int:
        """Drop the unlocked device entries under the cache salts `salts` accepts (one
        tenant's flush); returns the device blocks freed."""
        ...


@runtime_checkable
class HostTieredCache(PrefixCache, Protocol):
    """A prefix cache that can have a host KV tier (`host`; None: it has none). The scheduler's
    KV manager drives these only when `host` is set."""

    def load(self, handle: Any) -> list[int] | None:
        """Bring the host-resident part of the locked path `handle` to the device (queues
        SwapIn ops); the path's whole device block table, or None when blocks are short."""
        ...

    def take_swap_ops(self) -> list[SwapIn | SwapOut]:
        """The swap ops queued since the last call, in the order they were made."""
        ...

    def stale_nodes(self, device_blocks: set[int], host_blocks: set[int]) -> list[Any]:
        """The entries `discard_copies` would drop (read-only)."""
        ...

    def discard_copies(self, device_blocks: set[int], host_blocks: set[int]) -> None:
        """Forget the copies a failed step's block ops may not have made."""
        ...


def host_tier_of(cache: PrefixCache) -> HostTieredCache | None:
    """`cache` when it has a host tier, else None."""
    if isinstance(cache, HostTieredCache) and cache.host is not None:
        return cache
    return None
