"""The storage KV tier (L3) as a layer under the host tier: `StorageRadixCache(HostRadixCache)`.

The tree keeps no node for what is only in storage; storage is content-addressed
(`radixrt.cache.storage`), so the layer needs only the tokens to name pages:
- write-through: an insert that adds a leaf queues a `StorePage` for each full block whose last
  token is on the new edge (block indices start // B .. end // B - 1; a block ending inside a
  later edge is written when that edge enters), under the key of its whole prefix. The runner
  copies them off the device and writes them in the background (bounded; drops are counted).
- prefetch: `begin_fetch` takes host blocks (evicting host entries for room) for the pages of a
  request's prompt past its L1/L2 match and queues one `FetchPages`; the layer holds those host
  blocks outside the tree until `finish_fetch`, which puts the loaded run into the tree as one
  host-only leaf (the request's next match finds it on the host, and `load` brings it to the
  device) and frees the rest.
- write-back: a host-only entry leaving the host tier queues a `StoreHostPage` for each full
  block whose last token is on its edge (as write-through numbers them); the runner writes
  those whose write-through never reached storage (dropped under pressure, or the store was
  down), so a prefix evicted from GPU and host is still found in storage.
- KV events (with `events`): the pages of those writes and of fetched leaves are named to a
  `StorageEventRecorder`, which announces them when the runner reports they landed.
Plain Python (no torch).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from radixrt.cache.base import InsertResult
from radixrt.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU
from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.cache.radix_host import HostRadixCache
from radixrt.cache.radix_node import RadixNode, TreeObserver
from radixrt.cache.storage import (
    FetchDone,
    FetchPages,
    PagesRemoved,
    PagesStored,
    StorageResult,
    StorageTier,
)
from radixrt.cache.storage_events import StorageEventRecorder
from radixrt.cache.tiers import KVTier
from radixrt.kv.allocator import BlockAllocator

MAX_FETCH_FRACTION = 2  # a fetch takes at most 1/this of the host pool


@dataclass
class _Fetch:
    tokens: list[int]  # the prompt prefix whose pages first.. were asked for
    namespace: CacheNamespace
    first: int  # block index of the first page asked for
    keys: tuple[bytes, ...]  # the keys of the pages asked for
    host_blocks: list[int]  # one per page asked for, held until the fetch ends


class StorageRadixCache(HostRadixCache):
    """A host-tier radix tree over a storage tier (see the module docstring)."""

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        host: KVTier,
        storage: StorageTier,
        observer: TreeObserver | None = None,
        events: StorageEventRecorder | None = None,
    ) -> None:
        """`events`: the storage tier's KV events (None: off)."""
        super().__init__(allocator, block_size, host, observer)
        self.storage = storage
        self.events = events
        self._fetches: dict[int, _Fetch] = {}
        self._next_ticket = 0

    # ---- write-through ----
    def insert(
        self,
        tokens: Sequence[int],
        blocks: Sequence[int],
        namespace: CacheNamespace = DEFAULT_NAMESPACE,
        priority: int = 0,
    ) -> InsertResult:
        """`RadixCache.insert`, then write-through of the new leaf's full blocks."""
        result = super().insert(tokens, blocks, namespace, priority)
        if result.num_new_tokens:
            leaf, bs = result.handle, self.block_size
            lo, hi = leaf.start // bs, leaf.end // bs
            if hi > lo:
                keys = self.storage.keyer.keys(tokens[: hi * bs], namespace)[lo:]
                self.storage.store(leaf.blocks[: hi - lo], keys)
                if self.events is not None:
                    self.events.expect(keys, leaf, tokens)
        return result

    # ---- write-back ----
    def _evict_host_one(self) -> None:
        """Write-back of the first host candidate's pages when it leaves the tree (a host copy
        of a device entry loses no KV), then the host tier's eviction."""
        node = self._host_evictable[0]
        if not node.blocks:
            bs = self.block_size
            lo, hi = node.start // bs, node.end // bs
            if hi > lo:
                tokens = [t for n in self._path(node) for t in n.key]
                keys = self.storage.keyer.keys(tokens[: hi * bs], self._namespace_of(node))
                self.storage.write_back(node.host_blocks[: hi - lo], keys[lo:])
                if self.events is not None:
                    self.events.expect(keys[lo:], node, tokens)
        super()._evict_host_one()

    # ---- prefetch ----
    def begin_fetch(
        self, tokens: Sequence[int], namespace: CacheNamespace, num_cached: int
    ) -> int | None:
        """Ask storage for the pages of `tokens` from the one holding position `num_cached`
        (the L1/L2 match) on: host blocks for them (evicting host entries), one FetchPages.
        Returns its ticket, or None when no full page is past the match or the host has no
        room."""
        bs = self.block_size
        first = num_cached // bs
        num = self.pages_to_fetch(len(tokens), num_cached)
        if num <= 0:
            return None
        host_blocks = self._host_allocate(num)
        if host_blocks is None:
            return None
        tokens = list(tokens[: (first + num) * bs])
        keys = self.storage.keyer.keys(tokens, namespace)[first:]
        ticket = self._next_ticket
        self._next_ticket += 1
        self._fetches[ticket] = _Fetch(tokens, namespace, first, tuple(keys), host_blocks)
        self.storage.fetch(FetchPages(ticket, tuple(keys), tuple(host_blocks)))
        return ticket

    def pages_to_fetch(self, num_tokens: int, num_cached: int) -> int:
        """How many pages `begin_fetch` would ask for past a match of `num_cached` tokens in a
        prefix of `num_tokens` (<= 0: none)."""
        first = num_cached // self.block_size
        room = self.host.allocator.num_blocks // MAX_FETCH_FRACTION
        return min(num_tokens // self.block_size - first, room)

    @property
    def num_fetches(self) -> int:
        """Fetches that have not ended yet."""
        return len(self._fetches)

    def fetching(self, ticket: int) -> bool:
        """Whether the fetch `ticket` has not ended yet."""
        return ticket in self._fetches

    def finish_storage_io(self, results: list[StorageResult]) -> None:
        """Take what the runner side reports (`StorageRunner.storage_io`), in order: finished
        fetches enter the tree, stored and removed pages go to the KV events."""
        for result in results:
            if isinstance(result, FetchDone):
                self.finish_fetch(result)
            elif self.events is None:
                continue
            elif isinstance(result, PagesStored):
                self.events.landed(result.keys)
            else:
                assert isinstance(result, PagesRemoved)
                self.events.removed(result.keys)

    def finish_fetch(self, done: FetchDone) -> int:
        """Put the pages a fetch loaded into the tree, past what is cached by now, as a
        host-only leaf; free the other host blocks. Returns the pages that entered."""
        f = self._fetches.pop(done.ticket)
        bs, k = self.block_size, done.num_pages
        self.storage.stats.pages_fetched += k
        self.storage.cost.observe_fetch(k, done.page_bytes, done.lookup_s, done.read_s)
        end = (f.first + k) * bs
        top = self._root_of(f.namespace, create=bool(k))
        path, pos = self._walk(f.tokens[:end], top)
        start_page = pos // bs - f.first  # the first loaded page the leaf keeps
        if k == 0 or pos >= end or start_page < 0:  # nothing new, or a gap before the pages
            self.host.allocator.decref(f.host_blocks)
            if k and not top.children:
                self._detach_empty_root(top, f.namespace)
            return 0
        self.host.allocator.decref(f.host_blocks[:start_page] + f.host_blocks[k:])
        leaf = RadixNode(next(self._ids), f.tokens[pos:end], pos, [])
        leaf.last_access = self._clock
        leaf.host_blocks = f.host_blocks[start_page:k]
        parent = path[-1] if path else top
        self.version += 1
        self._unlist(parent)
        parent.children[leaf.key[0]] = leaf
        leaf.parent = parent
        self._total_tokens += len(leaf.key)
        for b in leaf.host_blocks:  # the leaf takes over the fetch's reference
            self._host_refs[b] += 1
        # The observer knows only device entries as new: the leaf enters, leaves the device
        # and is stored on the host (events replay to what the tree holds).
        self.observer.added(leaf, f.namespace)
        self.observer.removed(leaf, MEDIUM_GPU)
        self.observer.stored(leaf, MEDIUM_CPU)
        if self.events is not None:
            self.events.found(f.keys[start_page:k], leaf, f.tokens)
        self._relist(leaf)
        self._relist(parent)
        self.storage.stats.pages_adopted += len(leaf.host_blocks)
        return len(leaf.host_blocks)

    def _detach_empty_root(self, top: RadixNode, namespace: CacheNamespace) -> None:
        """Drop a namespace root a fetch made that got no child (no memory per namespace)."""
        if top is not self.root and self._roots.get(namespace) is top:
            del self._roots[namespace]
            del self._root_namespaces[top.id]

    def check_integrity(self) -> None:
        """The host tier's checks, then the storage tier's KV events'."""
        super().check_integrity()
        if self.events is not None:
            self.events.check_integrity()

    # ---- layer hooks ----
    def _host_blocks_held(self) -> Counter[int]:
        """The host blocks of fetches in flight."""
        return Counter(b for f in self._fetches.values() for b in f.host_blocks)
