"""The radix tree's host-tier bookkeeping: `RadixHostTier`, a component that
`radixrt.cache.radix.RadixCache` builds and owns when it has a host tier (see that module for
the tiers' invariants and for what moves when).

Who owns what: the `HostTier` (`radixrt.cache.tiers`) holds the host block allocator, the
outbox of swap ops and the tier's counters. `RadixHostTier` owns that `HostTier` and the host
side of the tree's bookkeeping: the host reference counter (host block -> nodes recording it)
and the host eviction candidate list (nodes with a host copy that are on the device too, or
unlocked host-only leaves, in `host_eviction_key` order). Of a node it changes only
`host_blocks` and `in_host_lru`. The tree's shape, the device blocks and counters and the device
candidate list belong to `RadixCache`: it decides what moves (loading, writing back, host
eviction, forgetting the copies of a failed step) and calls these methods around its own
changes. Plain Python (no torch).
"""

from __future__ import annotations

from collections import Counter

from sortedcontainers import SortedKeyList

from radixrt.cache.kv_events import MEDIUM_CPU
from radixrt.cache.radix_events import RadixEventRecorder
from radixrt.cache.radix_node import RadixNode, drop_ref
from radixrt.cache.tiers import HostTier
from radixrt.plan import SwapIn, SwapOut


class RadixHostTier:
    """Host copies of the radix tree's nodes (see the module docstring). `events`: the cache's
    KV event recorder (told of every host copy made or dropped), or None."""

    def __init__(self, host: HostTier, events: RadixEventRecorder | None) -> None:
        self.host = host
        self.events = events
        self.refs: Counter[int] = Counter()  # host block -> nodes recording it
        # Host eviction candidates, in eviction order (`host_eviction_key`).
        self.evictable = SortedKeyList(key=host_eviction_key)

    @property
    def num_cached_blocks(self) -> int:
        """Distinct host blocks the tree holds a reference on."""
        return len(self.refs)

    def take_ops(self) -> list[SwapIn | SwapOut]:
        """Swap ops made since the last call, in order."""
        return self.host.take_ops()

    # ---- the candidate list ----------------------------------------------------------

    def unlist(self, node: RadixNode) -> None:
        """Take a listed `node` (`in_host_lru`) off the candidate list."""
        self.evictable.remove(node)
        node.in_host_lru = False

    def relist(self, node: RadixNode) -> None:
        """List an unlisted `node` when it is a host eviction candidate."""
        if is_host_candidate(node):
            self.evictable.add(node)
            node.in_host_lru = True

    def pop_lru(self) -> RadixNode:
        """Take the first host eviction candidate off the (non-empty) list."""
        node = self.evictable.pop(0)
        node.in_host_lru = False
        return node

    # ---- host copies -----------------------------------------------------------------

    def write_back(self, node: RadixNode, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Queue copies of `device_blocks` into the first host blocks (pairwise) and record
        `host_blocks` as `node`'s host copy (the node takes over one reference each; a last
        block beyond `device_blocks` is one whose content is written already)."""
        self.host.write_back(device_blocks, host_blocks[: len(device_blocks)])
        node.host_blocks = host_blocks
        for b in host_blocks:
            self.refs[b] += 1
        if self.events is not None:
            self.events.stored(node, MEDIUM_CPU)

    def load(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Queue copies of `host_blocks` into `device_blocks` (pairwise)."""
        self.host.load(host_blocks, device_blocks)

    def hold_split(self, upper: RadixNode) -> None:
        """`upper`, the upper half of a split inside a block, records its last host block, which
        the lower half records too: one more reference."""
        b = upper.host_blocks[-1]
        self.host.allocator.incref([b])
        self.refs[b] += 1

    def drop_copy(self, node: RadixNode) -> int:
        """Release the node's host blocks; returns host blocks freed."""
        dropped, node.host_blocks = node.host_blocks, []
        for b in dropped:
            drop_ref(self.refs, b)
        if dropped and self.events is not None:
            self.events.removed(node, MEDIUM_CPU)
        return self.host.allocator.decref(dropped) if dropped else 0


def is_host_candidate(node: RadixNode) -> bool:
    """A host eviction candidate: a host copy of a device node, or an unlocked host-only
    leaf."""
    return bool(node.host_blocks) and (
        bool(node.blocks) or (node.lock_ref == 0 and not node.children)
    )


def host_eviction_key(node: RadixNode) -> tuple[bool, int, int]:
    """Host eviction order: host copies of device nodes first (dropping one loses no KV), the
    most recently used first (device eviction takes the least recently used, so their host
    copies are needed soonest); then host-only leaves, least recently used first."""
    if node.blocks:
        return (False, -node.last_access, -node.id)
    return (True, node.last_access, node.id)
