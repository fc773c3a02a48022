"""KV events of the storage tier: the pages the store holds, as vLLM events on its medium
(`MEDIUM_DISK` for a directory, `MEDIUM_EXTERNAL` for Redis: `radixrt.cache.kv_events`).

The scheduler side writes nothing itself; the runner reports in order which writes landed
(`PagesStored`) and which pages it saw leave the store (`PagesRemoved`), by storage key. A
page's event names its block as the GPU and CPU events do (the tree's `node.block_hashes`,
not the storage key), remembered when its write is queued (`expect`), while the node is in
the tree.

Held (announced, not removed since):
- a write-through or write-back page, once its write lands (a dropped or failed write is
  never announced);
- a page a fetch loads into the tree, so a store warm from an earlier process is announced
  as requests find its pages (the rest of it stays unannounced: no event names a page this
  process has not seen);
- removed when the runner reports it gone: a local directory's deletions for room, or a
  fetch that did not find it whole. A Redis server's own evictions (and a shared
  directory's deletions by another process) are seen only by such a fetch;
- the oldest held page is removed (announced so) past `max_held` pages: the router then
  under-counts the store, never over-counts it.
Plain Python; nothing exists while KV events are off.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from radixrt.cache.radix_events import RadixEventRecorder
from radixrt.cache.radix_node import RadixNode

MAX_HELD_PAGES = 1 << 18  # pages whose events are remembered (a store of more under-counts)


@dataclass(frozen=True, slots=True)
class _Page:
    block_hash: bytes  # the block's event hash (the tree's)
    parent: bytes | None  # the event hash of the block before it; None: the first block
    token_ids: list[int]  # its block_size tokens


class StorageEventRecorder:
    """See the module docstring. `max_pending`: queued writes whose pages are remembered (at
    least the ops of a step: the device and host blocks)."""

    def __init__(
        self,
        events: RadixEventRecorder,
        medium: str,
        max_pending: int,
        max_held: int = MAX_HELD_PAGES,
    ) -> None:
        self.events = events
        self.medium = medium
        self.max_pending = max_pending
        self.max_held = max_held
        self._pending: OrderedDict[bytes, _Page] = OrderedDict()  # storage key -> page
        self._held: OrderedDict[bytes, bytes] = OrderedDict()  # storage key -> event hash

    def expect(self, keys: Sequence[bytes], node: RadixNode, tokens: Sequence[int]) -> None:
        """Pages `keys` of `node`'s full blocks (all of them, in order; the node is in the
        tree) are queued for writing; `tokens`: its path from position 0."""
        bs = self.events.block_size
        first, hashes = node.start // bs, node.block_hashes
        assert hashes is not None and len(hashes) == len(keys)
        parent = self.events.hash_before(node, first)
        for i, key in enumerate(keys):
            lo = (first + i) * bs
            self._pending[key] = _Page(hashes[i], parent, list(tokens[lo : lo + bs]))
            self._pending.move_to_end(key)
            parent = hashes[i]
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)

    def found(self, keys: Sequence[bytes], node: RadixNode, tokens: Sequence[int]) -> None:
        """A fetch loaded pages `keys` into `node` (as `expect`): they are in the store."""
        self.expect(keys, node, tokens)
        self.landed(keys)

    def landed(self, keys: Sequence[bytes]) -> None:
        """The writes of `keys` landed: BlockStored for those not held, in runs of a chain."""
        run: list[_Page] = []
        for key in keys:
            page = self._pending.pop(key, None)
            if page is None or key in self._held:  # not ours to name, or announced already
                continue
            self._held[key] = page.block_hash
            if run and page.parent != run[-1].block_hash:
                self._hold(run)
                run = []
            run.append(page)
        if run:
            self._hold(run)
        while len(self._held) > self.max_held:
            _, block_hash = self._held.popitem(last=False)
            self.events.release([block_hash], self.medium)

    def removed(self, keys: Sequence[bytes]) -> None:
        """Pages `keys` left the store: BlockRemoved for those held."""
        gone = [self._held.pop(k) for k in keys if k in self._held]
        self.events.release(gone, self.medium)

    def held(self) -> set[bytes]:
        """Storage keys of the pages announced and not removed."""
        return set(self._held)

    def check_integrity(self) -> None:
        """The recorder counts on the medium exactly the held pages, within the bounds."""
        want = Counter(self._held.values())
        assert self.events.held_counts(self.medium) == want, "storage events out of sync"
        assert len(self._held) <= self.max_held and len(self._pending) <= self.max_pending

    def _hold(self, run: list[_Page]) -> None:
        tokens = [t for page in run for t in page.token_ids]
        self.events.hold([p.block_hash for p in run], run[0].parent, tokens, self.medium)
