"""Block-hash prefix cache: vLLM automatic prefix caching semantics (the baseline).

Only full blocks are cached, each under the hash chain H_i = sha256(H_{i-1} || tokens of
block i) with a fixed H_{-1}, so a block matches only after the same whole prefix. A
match stops at the first uncached block; up to B - 1 tokens of a partial block are never
reused. No de-duplication: a second block with the same content is not cached.

The cache holds one reference per cached block. Handles are tuples of cached blocks;
`lock` / `unlock` count per block which are in use (they never touch the allocator), like
vLLM's per-block ref_cnt. Unlocked cached blocks wait in an LRU queue ordered by the
time they were last matched, inserted or unlocked; ties (one call) put later blocks of a
chain first, as vLLM frees a request's blocks in reverse order. `evict` frees from the
front of the queue, skipping blocks someone else still references.

Complexity (n = query tokens): match / insert O(n) hashing plus O(log N) per touched
block; lock / unlock O(log N) per block; evict O(log N) per freed block (plus one step per
skipped block, which only happens when a request holds a cached block without locking
it); evictable_blocks, cached_blocks O(1).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

from radixrt.cache.base import CacheStats, InsertResult, MatchResult
from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.kv.allocator import BlockAllocator

if TYPE_CHECKING:
    from radixrt.cache.tiers import KVTier

_SEED = b"radixrt-blockhash-v1"


class BlockHashCache:
    """Full-block prefix cache; see the module docstring and `radixrt.cache.base`.

    `evictable_blocks` counts cached blocks no handle has locked. It equals what `evict`
    could free when every request that holds a cached block has locked it (the scheduler
    protocol); a block held but not locked is counted yet skipped by `evict`.
    """

    mode = "blockhash"

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.stats = CacheStats()
        self.version = 0  # bumped by every eviction (match results go stale)
        self.host: KVTier | None = None  # no host KV tier
        self._clock = 0
        self._hash_to_block: dict[bytes, int] = {}
        self._block_hash: dict[int, bytes] = {}  # inverse of _hash_to_block
        self._block_index: dict[int, int] = {}  # cached block -> its index in the chain
        self._block_salt: dict[int, str | None] = {}  # cached block -> its namespace's salt
        self._last_access: dict[int, int] = {}  # cached block -> clock of last use
        self._lock_count: Counter[int] = Counter()  # cached block -> locks (> 0 only)
        # Unlocked cached blocks as (last_access, -chain index, block), evicted first first.
        self._queue: SortedList = SortedList()

    # ---- queries -------------------------------------------------------------------

    def block_hashes(
        self, tokens: Sequence[int], namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> list[bytes]:
        """Chain hashes of the full blocks of `tokens` in `namespace` (it seeds the chain, so
        no block hash of one namespace equals one of another)."""
        bs, hashes = self.block_size, []
        h = namespace.chain_seed(_SEED)
        for i in range(len(tokens) // bs):
            h = hashlib.sha256(h + array("q", tokens[i * bs : (i + 1) * bs]).tobytes()).digest()
            hashes.append(h)
        return hashes

    def match(
        self, tokens: Sequence[int], namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> MatchResult:
        """Cached full blocks of the longest cached block-aligned prefix; refreshes their
        access time. Takes no references. Handle: tuple of the matched blocks."""
        blocks = []
        for h in self.block_hashes(tokens, namespace):
            b = self._hash_to_block.get(h)
            if b is None:
                break
            blocks.append(b)
        self._touch(blocks)
        num_cached = len(blocks) * self.block_size
        return MatchResult(blocks, num_cached, tuple(blocks))

    @property
    def evictable_blocks(self) -> int:
        """Cached blocks no handle has locked (see the class docstring)."""
        return len(self._queue)

    @property
    def cached_blocks(self) -> int:
        return len(self._block_hash)

    @property
    def host_cached_blocks(self) -> int:
        return 0  # no host KV tier

    def held_refs(self) -> Counter[int]:
        """Block -> references held by the cache (one per cached block)."""
        return Counter(self._block_hash.keys())

    # ---- locking -------------------------------------------------------------------

    def lock(self, handle: tuple[int, ...]) -> None:
        """Mark the handle's blocks in use: `evict` will not touch them."""
        for b in handle:
            assert b in self._block_hash, f"lock of uncached block {b}"
            if b not in self._lock_count:
                self._queue.remove(self._queue_key(b))
            self._lock_count[b] += 1

    def unlock(self, handle: tuple[int, ...]) -> None:
        """Undo one `lock(handle)`; blocks no longer locked join the LRU queue as used now."""
        stamp = self._tick()
        for b in handle:
            assert self._lock_count[b] > 0, f"unlock of unlocked block {b}"
            if self._lock_count[b] == 1:
                del self._lock_count[b]
                self._last_access[b] = stamp
                self._queue.add(self._queue_key(b))
            else:
                self._lock_count[b] -= 1

    # ---- mutation ------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        blocks: Sequence[int],
        namespace: CacheNamespace = DEFAULT_NAMESPACE,
        priority: int = 0,
    ) -> InsertResult:
        """Cache blocks[i] under H_i for every full block i whose hash is not cached yet
        (one new reference each). Returns the tuple of the cached blocks for all full
        blocks of `tokens` (some may be other requests' blocks): lock it at once."""
        num_full = len(tokens) // self.block_size
        assert len(blocks) >= num_full, f"{len(blocks)} blocks for {num_full} full blocks"
        stamp = self._tick()
        handle, num_new = [], 0
        for i, h in enumerate(self.block_hashes(tokens, namespace)):
            b = self._hash_to_block.get(h)
            if b is None:
                b = blocks[i]
                assert b not in self._block_hash, f"block {b} already cached for other tokens"
                self.allocator.incref([b])
                self._hash_to_block[h] = b
                self._block_hash[b] = h
                self._block_index[b] = i
                self._block_salt[b] = namespace.salt
                self._last_access[b] = stamp
                self._queue.add(self._queue_key(b))
                num_new += 1
            handle.append(b)
        self._touch(handle, stamp)
        num_new_tokens = num_new * self.block_size
        self.stats.num_inserted_tokens += num_new_tokens
        return InsertResult(tuple(handle), num_new_tokens)

    def locked_blocks(self, handle: tuple[int, ...]) -> list[int]:
        """The handle's blocks."""
        return list(dict.fromkeys(handle))

    def prefix_boundaries(self, handle: tuple[int, ...]) -> list[int]:
        """Block boundaries play no part in admission retries: [] (only the empty prefix)."""
        return []

    def evict(self, num_blocks: int) -> int:
        """Free unlocked cached blocks referenced by the cache alone, least recently used
        first, until `num_blocks` became free or none is left. Returns blocks freed."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        freed, i = 0, 0
        while freed < num_blocks and i < len(self._queue):
            b = self._queue[i][2]
            if self.allocator.ref_counts[b] != 1:
                i += 1  # held by a request that did not lock it: skip
                continue
            del self._queue[i]
            self.version += 1
            self._uncache(b)
            freed += self.allocator.decref([b])
        self.stats.num_evicted_blocks += freed
        return freed

    def reset(self) -> None:
        """Drop every unlocked entry, releasing the cache's reference."""
        freed = 0
        while self._queue:
            b = self._queue.pop(0)[2]
            self.version += 1
            self._uncache(b)
            freed += self.allocator.decref([b])
        self.stats.num_evicted_blocks += freed

    # ---- internals -----------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _queue_key(self, b: int) -> tuple[int, int, int]:
        return (self._last_access[b], -self._block_index[b], b)

    def _touch(self, blocks: Sequence[int], stamp: int | None = None) -> None:
        stamp = self._tick() if stamp is None else stamp
        for b in blocks:
            if b in self._lock_count:
                self._last_access[b] = stamp
            elif self._last_access[b] != stamp:
                self._queue.remove(self._queue_key(b))
                self._last_access[b] = stamp
                self._queue.add(self._queue_key(b))

    def _uncache(self, b: int) -> None:
        del self._hash_to_block[self._block_hash.pop(b)]
        del self._block_index[b]
        del self._block_salt[b]
        del self._last_access[b]

    # ---- debugging -----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the hash maps are inverse, locks cover cached blocks, queue is exact."""
        assert len(self._hash_to_block) == len(self._block_hash)
        for h, b in self._hash_to_block.items():
            assert self._block_hash[b] == h
            assert self.allocator.ref_counts[b] >= 1, f"cached block {b} is free"
        assert self._block_index.keys() == self._block_hash.keys()
        assert self._block_salt.keys() == self._block_hash.keys()
        assert self._last_access.keys() == self._block_hash.keys()
        for b, c in self._lock_count.items():
            assert c > 0 and b in self._block_hash
        unlocked = {b for b in self._block_hash if b not in self._lock_count}
        assert len(self._queue) == len(unlocked)
        assert {key[2] for key in self._queue} == unlocked
        for key in self._queue:
            assert key == self._queue_key(key[2])

    def flush_salts(self, salts: Callable[[str | None], bool]) -> int:
        """Drop the unlocked cached blocks inserted under the salts `salts` accepts (each
        block's salt is recorded at insert: its chain hash hides it); returns blocks freed."""
        freed = 0
        for key in [k for k in self._queue if salts(self._block_salt[k[2]])]:
            self._queue.remove(key)
            self.version += 1
            self._uncache(key[2])
            freed += self.allocator.decref([key[2]])
        self.stats.num_evicted_blocks += freed
        return freed
