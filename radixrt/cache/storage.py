"""The storage KV tier (L3), seen from the cache: page keys, the backend protocol, its counters,
and the ops the scheduler side sends to the runner side (plain Python, no torch).

A page is one full KV block in the host pool's page-first layout (every layer's K and V of its
`block_size` tokens, contiguous: `radixrt.kv.host_pool`), so one page is one stored object.
Pages are content-addressed: a page's key is the block-hash chain of the KV events
(`radixrt.cache.kv_events.BlockHasher`) over its tokens and its whole prefix, whose first parent
is the cache namespace's `chain_seed` of the `StorageIdentity` digest. So a key differs when
the tokens of any earlier block, the tenant's salt, the model or its revision, the KV dtype, the
FP8 scales, the layout or the TP rank differ, and equal keys name interchangeable KV.

Backends (`StorageBackend`) keep pages beyond the process: the local directory
(`radixrt.cache.storage_local`) and Redis (`radixrt.cache.storage_redis`);
`radixrt.cache.storage_backends.open_backend` picks one from the `kv_storage` option. Both
store a page as `page_header` then the payload, and anything a backend cannot read back whole
and checked (`check_header`, then the CRC) is a miss, never wrong KV.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from radixrt.cache.kv_events import MEDIUM_DISK, BlockHasher
from radixrt.cache.namespace import CacheNamespace
from radixrt.cache.storage_cost import StorageCostModel

KEY_BYTES = 32  # a page key: one SHA-256 digest
STORAGE_HASH_SEED = "radixrt-kv-storage"  # the chain's NONE_HASH seed (fixed: keys outlive runs)
MAGIC = b"RXKVPAGE"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sI32sQI")  # magic, version, key, payload length, crc32 of the payload


def page_header(key: bytes, payload: memoryview) -> bytes:
    """The header stored before `payload` (the page of `key`)."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, key, len(payload), zlib.crc32(payload))


def check_header(head: bytes, key: bytes, page_bytes: int) -> int | None:
    """The payload's CRC-32 if `head` is a header of this format for `key`'s page of
    `page_bytes` bytes, else None (the page is torn, foreign or of another format)."""
    if len(head) != HEADER.size:
        return None
    magic, version, stored_key, length, crc = HEADER.unpack(head)
    if (magic, version, stored_key, length) != (MAGIC, FORMAT_VERSION, key, page_bytes):
        return None
    return crc


@dataclass(frozen=True)
class StorageIdentity:
    """What makes stored KV interchangeable beyond the tokens and the namespace: a page is
    reused only by a process whose identity is equal."""

    model: str  # the checkpoint (path or hub id)
    revision: str  # the weights' revision (a hub commit, or a digest of the files' sizes/times)
    kv_dtype: str  # the pool's dtype (`KVPool.kv_cache_dtype`)
    kv_scales: str  # FP8 K/V scales (their values; "" without fp8)
    layout: str  # the page layout: "page-first" and the shape [L, 2, B, H, D]
    tp_rank: int = 0  # the tensor-parallel rank whose heads the page holds
    tp_size: int = 1

    def digest(self) -> bytes:
        """SHA-256 of the fields (the base of every page key's chain)."""
        text = "\x1f".join(
            [
                self.model,
                self.revision,
                self.kv_dtype,
                self.kv_scales,
                self.layout,
                str(self.tp_rank),
                str(self.tp_size),
            ]
        )
        return hashlib.sha256(text.encode()).digest()


class PageKeyer:
    """Page keys of one identity and block size (see the module docstring)."""

    def __init__(self, identity: StorageIdentity, block_size: int) -> None:
        self.identity = identity
        self.block_size = block_size
        self._base = identity.digest()
        self._hasher = BlockHasher(block_size, seed=STORAGE_HASH_SEED)

    def keys(self, tokens: Sequence[int], namespace: CacheNamespace) -> list[bytes]:
        """Keys of the full blocks of `tokens` (a sequence from position 0), in order; a last
        partial block has none."""
        num_full = len(tokens) // self.block_size * self.block_size
        if not num_full:
            return []
        seed = namespace.chain_seed(self._base)
        return self._hasher.chain(seed, list(tokens[:num_full]))


@dataclass
class StorageStats:
    """A backend's counters (since it was opened)."""

    num_pages: int = 0  # pages stored now (as far as this process knows)
    num_bytes: int = 0  # their bytes, headers included
    hits: int = 0  # pages `get` read back whole and checked
    misses: int = 0  # pages `get` found absent, torn, corrupt or foreign
    corrupt: int = 0  # of the misses, pages present but unreadable (deleted when found)
    bytes_read: int = 0
    bytes_written: int = 0
    pages_written: int = 0
    pages_evicted: int = 0  # deleted to stay within the size bound (least recently used first)


class StorageUnavailable(Exception):
    """The store cannot be reached (or did not answer) now; the backend tries again later,
    backing off. The caller treats the call as failed: a read as a miss, a write as lost."""


class StorageBackend(Protocol):
    """A store of pages by key. Thread-safe: the runner's storage thread calls it. Buffers are
    writable byte buffers (memoryview, numpy uint8 arrays) of exactly `page_bytes` bytes:
    pinned host memory on CUDA. Any call may raise `StorageUnavailable`."""

    page_bytes: int  # payload bytes of one page

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (a later `get` may still miss: a page can be deleted or
        found corrupt in between)."""
        ...

    def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each key's page into the buffer beside it; False where it is absent or does
        not check (the buffer's content is undefined then)."""
        ...

    def set(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[bytes]:
        """Store each buffer under the key beside it (a key already stored keeps its page).
        Returns the keys of the pages it deleted to stay within its size bound ([] for a
        store that bounds itself: Redis evicts unseen)."""
        ...

    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove the keys' pages (absent ones are ignored)."""
        ...

    def stats(self) -> StorageStats:
        """A copy of the counters."""
        ...

    def close(self) -> None:
        """Release connections and files (the pages stay)."""
        ...


def leading_run(flags: Sequence[bool]) -> int:
    """How many of `flags` are True before the first False."""
    for i, ok in enumerate(flags):
        if not ok:
            return i
    return len(flags)


# ---- between the scheduler's side and the runner's (`Runner.storage_io`) ----


@dataclass(frozen=True, slots=True)
class StorePage:
    """Write device block `device_block` (a full, cached block) to storage under `key`. The
    runner copies it off the device before any later step's op or forward can rewrite it,
    then writes it in the background; with its staging buffers full the page is dropped."""

    device_block: int
    key: bytes


@dataclass(frozen=True, slots=True)
class StoreHostPage:
    """Write-back: host block `host_block` holds a full page leaving the host tier; write it
    under `key` if its write-through did not reach storage (dropped or failed). The runner
    copies it before any later op or fetch can rewrite the block."""

    host_block: int
    key: bytes


@dataclass(frozen=True, slots=True)
class FetchPages:
    """Read the longest run of `keys` that storage holds into `host_blocks` (pairwise), in
    the background; the scheduler holds those host blocks until the `FetchDone`."""

    ticket: int
    keys: tuple[bytes, ...]
    host_blocks: tuple[int, ...]


StorageOp = StorePage | StoreHostPage | FetchPages


@dataclass(frozen=True, slots=True)
class PagesStored:
    """Writes that landed: storage holds these pages now."""

    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """Pages that left storage, as far as the runner saw: deleted by the backend for room, or
    asked for by a fetch and not found whole (absent, torn or corrupt)."""

    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class FetchDone:
    """A finished `FetchPages`: its first `num_pages` host blocks hold their pages. The
    timings feed the load-or-recompute cost model (`radixrt.cache.storage_cost`)."""

    ticket: int
    num_pages: int
    page_bytes: int = field(default=0, compare=False)  # payload bytes of one page
    lookup_s: float = field(default=0.0, compare=False)  # seconds the `exists` call took
    read_s: float = field(default=0.0, compare=False)  # seconds the `get` of the pages took


StorageResult = FetchDone | PagesStored | PagesRemoved  # what the runner side reports, in order


@dataclass
class StorageIOStats:
    """The runner side's counters of the storage tier."""

    pages_queued: int = 0  # StorePage ops taken into a staging buffer
    pages_written_back: int = 0  # StoreHostPage ops taken (their write-through had not landed)
    write_drops: int = 0  # StorePage and StoreHostPage ops dropped: every staging buffer was busy
    write_errors: int = 0  # pages a backend failed to write (logged)
    fetch_errors: int = 0  # FetchPages a backend failed (they loaded nothing; logged)
    backend: StorageStats | None = None  # the backend's counters


@dataclass
class StorageTierStats:
    """The scheduler side's counters of the storage tier."""

    pages_stored: int = 0  # StorePage ops sent (write-through of new cache entries)
    pages_evicted: int = 0  # StoreHostPage ops sent (full pages of host-only entries evicted)
    fetches: int = 0  # FetchPages sent (a request missed L1/L2 on a full page)
    pages_asked: int = 0  # pages those asked for
    pages_fetched: int = 0  # pages they found (the longest stored run)
    pages_adopted: int = 0  # of those, pages that entered the tree (the rest was cached by then)
    prefetch_waits: int = 0  # requests that waited for a fetch
    prefetch_timeouts: int = 0  # of those, requests admitted before their fetch ended
    prefetch_wait_s: float = 0.0  # total time requests waited for fetches
    loads_chosen: int = 0  # prefixes the load policy sent to storage (the request waits)
    recomputes_chosen: int = 0  # prefixes the cost model left to prefill (no wait)
    probe_fetches: int = 0  # of those, fetches made anyway to measure storage (no wait)


class StorageTier:
    """The scheduler side of the storage tier: the page keyer, the ops for the runner (in the
    order they were made), the load-or-recompute cost model and the counters."""

    def __init__(
        self,
        keyer: PageKeyer,
        prefetch_timeout_s: float,
        cost: StorageCostModel | None = None,
        medium: str = MEDIUM_DISK,
    ) -> None:
        """`cost`: the load-or-recompute decision (default: policy `auto`); `medium`: what KV
        events call the store (`radixrt.cache.storage_backends.storage_medium`)."""
        self.keyer = keyer
        self.medium = medium
        self.prefetch_timeout_s = prefetch_timeout_s  # a request waits this long for a fetch
        self.cost = cost if cost is not None else StorageCostModel()
        self.stats = StorageTierStats()
        self._ops: list[StorageOp] = []

    def store(self, device_blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Queue write-through of `device_blocks` under `keys` (pairwise)."""
        self._ops += [StorePage(b, k) for b, k in zip(device_blocks, keys, strict=True)]
        self.stats.pages_stored += len(keys)

    def write_back(self, host_blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Queue write-back of the evicted `host_blocks` under `keys` (pairwise)."""
        self._ops += [StoreHostPage(b, k) for b, k in zip(host_blocks, keys, strict=True)]
        self.stats.pages_evicted += len(keys)

    def fetch(self, op: FetchPages) -> None:
        self._ops.append(op)
        self.stats.fetches += 1
        self.stats.pages_asked += len(op.keys)

    def take_ops(self) -> list[StorageOp]:
        """The ops queued since the last call, in order (clears them)."""
        ops, self._ops = self._ops, []
        return ops


class StorageRunner(Protocol):
    """A runner with a storage tier (`radixrt.executor.runner.ModelRunner` with
    `kv_storage`)."""

    storage_identity: StorageIdentity | None  # None: no storage tier

    def storage_io(self, ops: list[StorageOp]) -> list[StorageResult]:
        """Start `ops`; what finished since the last call, in order: fetches, writes that
        landed, pages seen leaving the store."""
        ...

    def storage_wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` until a fetch finishes (at once when one has finished
        since the last `storage_io`). For a loop whose step planned nothing."""
        ...

    def storage_stats(self) -> StorageIOStats:
        """The runner side's counters."""
        ...
