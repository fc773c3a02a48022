"""The host KV tier as a layer over the radix tree: `HostRadixCache(RadixCache)`.

A node's KV is on the device (`blocks`), on the host (`host_blocks`), or both; an empty list
means "not in that tier". The nodes on the device form a subtree containing the root (a device
node's parent is on the device), so a path runs device nodes first, then host-only ones.
Device eviction takes LRU device leaves (unlocked, no child on the device) and writes their
blocks back to the host (a SwapOut op per block; none when the node already has a host copy)
instead of removing them; only when the host cannot make room is the leaf removed with its
host-only subtree. The host tier evicts for real: host copies of nodes that are on the device
too first (that loses no KV; most recently used first), then host-only leaves (LRU first),
which leave the tree. `match` counts host-resident tokens as cached (`num_host_tokens`);
`load(handle)` brings them into fresh device blocks (SwapIn ops). A block index shared by a
parent and its child (an edge ending inside a block) moves once: the parent's write-back
shares its host-only child's copy of that block, and a load of both loads the deeper node's
copy once for both. Locking covers both tiers: a locked host-only node is never evicted. After
a failed step, `discard_copies` forgets the copies its swap ops may not have made.

The base tree owns the shape, the device blocks and counters and the device candidate list;
this layer owns the `KVTier` (host block allocator, swap op outbox, counters), the host
reference counter (host block -> nodes recording it) and the host candidate list, and changes
the base tree only through its layer hooks. Of a node it writes `host_blocks` and
`in_host_lru`, and `blocks` where a node moves between the tiers. Host blocks are reference
counted like device blocks: each node with a host copy holds one reference per host block it
records (a split inside a block adds one). Plain Python (no torch).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from sortedcontainers import SortedKeyList

from radixrt.cache.base import MatchResult
from radixrt.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU
from radixrt.cache.radix import RadixCache
from radixrt.cache.radix_check import check_candidates, walk
from radixrt.cache.radix_node import RadixNode, TreeObserver, drop_ref
from radixrt.cache.tiers import KVTier
from radixrt.kv.allocator import BlockAllocator
from radixrt.plan import SwapIn, SwapOut


class HostRadixCache(RadixCache):
    """A radix tree whose evicted nodes keep a copy in `host` (see the module docstring)."""

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        host: KVTier,
        observer: TreeObserver | None = None,
    ) -> None:
        super().__init__(allocator, block_size, observer)
        self.host = host
        self._host_refs: Counter[int] = Counter()  # host block -> nodes recording it
        # Host eviction candidates, in eviction order (`host_eviction_key`).
        self._host_evictable = SortedKeyList(key=host_eviction_key)

    @property
    def host_cached_blocks(self) -> int:
        """Distinct host blocks the tree holds a reference on."""
        return len(self._host_refs)

    def take_swap_ops(self) -> list[SwapIn | SwapOut]:
        """Swap ops made since the last call, in order."""
        return self.host.take_ops()

    # ---- moves between the tiers ----------------------------------------------------

    def load(self, handle: RadixNode) -> list[int] | None:
        """Bring the host-only nodes of the (locked) path root..handle to the device: a fresh
        device block per block index they cover (allocating may evict other nodes), one
        SwapIn op each; the nodes keep their host copies. A block index two of them share (an
        edge ending inside a block) is loaded once, from the deeper node's host copy (it
        holds the shallower node's positions too), and both record that device block.
        Returns the path's device block table, or None, with the path unchanged, when the
        device cannot free enough blocks. Caller: lock `handle` first."""
        path = self._path(handle)
        assert all(n.lock_ref > 0 for n in path), "load of an unlocked path"
        bs = self.block_size
        todo = [n for n in path if not n.blocks]
        source: dict[int, int] = {}  # block index -> host block to load (deepest node's)
        for node in todo:  # root side first
            assert node.host_blocks
            first = node.start // bs
            for k, h in enumerate(node.host_blocks):
                source[first + k] = h
        short = len(source) - self.allocator.num_free
        if short > 0:
            self.evict(short)
        if self.allocator.num_free < len(source):
            return None
        fresh = dict(zip(source, self.allocator.allocate(len(source))))  # one ref each
        self.host.load(list(source.values()), list(fresh.values()))
        held: set[int] = set()  # blocks whose allocation reference a node took already
        for node in todo:  # root side first: a parent is on the device before its child
            self._unlist(node)
            self._unlist(node.parent)
            first = node.start // bs
            node.blocks = [fresh[first + k] for k in range(len(node.host_blocks))]
            for b in node.blocks:  # the node's references
                if b in held:
                    self.allocator.incref([b])
                held.add(b)
                self._refs[b] += 1
                self._locked_refs[b] += 1
            self.observer.stored(node, MEDIUM_GPU)
            self._relist(node.parent)
            self._relist(node)
        return self._table(path)

    def stale_nodes(self, device_blocks: set[int], host_blocks: set[int]) -> list[RadixNode]:
        """The nodes `discard_copies(device_blocks, host_blocks)` takes off the device or out
        of the tree, deepest first. Read-only: the caller stops the requests locking any of
        them (on their paths) before it discards."""
        nodes, off_device = self._stale(device_blocks)
        return [
            n
            for n in reversed(nodes)
            if n.id in off_device or (not n.blocks and not host_blocks.isdisjoint(n.host_blocks))
        ]

    def discard_copies(self, device_blocks: set[int], host_blocks: set[int]) -> None:
        """Forget the copies a failed step may not have made: a node recording one of
        `device_blocks` loses its device copy, and so do its device descendants (a device
        node's parent is on the device); a node recording one of `host_blocks` loses its host
        copy; a node left with no copy leaves the tree with its subtree. Every node in
        `stale_nodes(...)` must be unlocked."""
        nodes, off_device = self._stale(device_blocks)
        for node in reversed(nodes):  # deepest first: children leave the device first
            bad_host = not host_blocks.isdisjoint(node.host_blocks)
            if node.parent is None or not (bad_host or node.id in off_device):
                continue
            assert not node.lock_ref or (node.id not in off_device and node.blocks), (
                f"discard_copies of a locked node at [{node.start}, {node.end})"
            )
            self.version += 1
            parent = node.parent
            self._unlist(node)
            self._unlist(parent)
            if bad_host:
                self._drop_copy(node)
            if node.id in off_device:
                self._release(node)
            if node.blocks or node.host_blocks:
                self._relist(node)
                self._relist(parent)
            else:
                self._remove_subtree(node)  # relists the parent

    def _stale(self, device_blocks: set[int]) -> tuple[list[RadixNode], set[int]]:
        """Every node, parents before children, and the ids of the device nodes that record
        one of `device_blocks` or lie below one that does."""
        nodes: list[RadixNode] = []
        off_device: set[int] = set()
        stack = [(c, False) for top in self.roots for c in top.children.values()]
        while stack:
            node, below = stack.pop()
            nodes.append(node)
            off = bool(node.blocks) and (below or not device_blocks.isdisjoint(node.blocks))
            if off:
                off_device.add(node.id)
            stack += [(c, off) for c in node.children.values()]
        return nodes, off_device

    def _evict_to_host(self, leaf: RadixNode) -> int:
        """Drop an (already unlisted) device leaf's device blocks, writing them back first
        unless it has a host copy; with no room on the host, remove it and its host-only
        subtree. Returns device blocks freed."""
        assert leaf.lock_ref == 0
        if not leaf.host_blocks:
            # An edge ending inside a block: a host-only child's copy of that block holds the
            # leaf's positions there too; share it (one reference, taken before allocating
            # may evict the child) instead of writing the block back again.
            shared = None
            if leaf.end % self.block_size:
                shared = next((c.host_blocks[0] for c in leaf.children.values()), None)
            if shared is not None:
                self.host.allocator.incref([shared])
            num_new = len(leaf.blocks) - (shared is not None)
            host_blocks = self._host_allocate(num_new)  # may relist `leaf`
            if host_blocks is None:
                if shared is not None:
                    self.host.allocator.decref([shared])
                freed = self._remove_subtree(leaf)
                self.host.stats.num_dropped_blocks += freed
                return freed
            self._unlist(leaf)
            if shared is not None:
                host_blocks.append(shared)
            self._write_back(leaf, leaf.blocks[:num_new], host_blocks)
        self._unlist(leaf)
        self._unlist(leaf.parent)
        freed = self._release(leaf)
        self._relist(leaf)
        self._relist(leaf.parent)
        return freed

    def _host_allocate(self, n: int) -> list[int] | None:
        """`n` fresh host blocks, evicting host entries for room (in `host_eviction_key`
        order); None, evicting nothing, when `n` exceeds the host pool."""
        alloc = self.host.allocator
        if n > alloc.num_blocks:
            return None
        while alloc.num_free < n and self._host_evictable:
            self._evict_host_one()
        return alloc.allocate(n) if alloc.num_free >= n else None

    def _evict_host_one(self) -> None:
        """Evict the first host candidate: a node on both tiers loses its host copy, a
        host-only leaf leaves the tree."""
        node = self._host_evictable.pop(0)
        node.in_host_lru = False
        if not node.blocks:
            self._detach(node)
        self.host.stats.num_host_evicted_blocks += self._drop_copy(node)

    def _remove_subtree(self, top: RadixNode) -> int:
        """Remove an unlocked (already unlisted) node without device children, and every
        (host-only) node below it; returns device blocks freed."""
        assert top.lock_ref == 0
        stack = list(top.children.values())
        while stack:
            node = stack.pop()
            assert not node.blocks and node.lock_ref == 0
            stack += node.children.values()
            self._unlist(node)
            node.children = {}
            node.parent = None
            self._total_tokens -= len(node.key)
            self._drop_copy(node)
        top.children = {}
        self._unlist(top)
        self._drop_copy(top)
        if not top.blocks:  # its device copy was discarded already
            self._detach(top)
            return 0
        return self._remove_leaf(top)

    # ---- host copies -----------------------------------------------------------------

    def _write_back(
        self, node: RadixNode, device_blocks: list[int], host_blocks: list[int]
    ) -> None:
        """Queue copies of `device_blocks` into the first host blocks (pairwise) and record
        `host_blocks` as `node`'s host copy (the node takes over one reference each; a last
        block beyond `device_blocks` is one whose content is written already)."""
        self.host.write_back(device_blocks, host_blocks[: len(device_blocks)])
        node.host_blocks = host_blocks
        for b in host_blocks:
            self._host_refs[b] += 1
        self.observer.stored(node, MEDIUM_CPU)

    def _drop_copy(self, node: RadixNode) -> int:
        """Release the node's host blocks (if any); returns host blocks freed."""
        dropped, node.host_blocks = node.host_blocks, []
        if not dropped:
            return 0
        for b in dropped:
            drop_ref(self._host_refs, b)
        self.observer.removed(node, MEDIUM_CPU)
        return self.host.allocator.decref(dropped)

    # ---- the base tree's layer hooks ---------------------------------------------------

    def _match_result(self, path: list[RadixNode], pos: int, node: RadixNode) -> MatchResult:
        """`blocks` cover the device-resident part; `num_host_tokens` tokens follow on the
        host only (`load` brings them to the device)."""
        num_host = sum(len(n.key) for n in path if not n.blocks)
        return MatchResult(self._table(path), pos, node, num_host)

    def _table(self, path: list[RadixNode]) -> list[int]:
        """Device block table of the device-resident nodes of `path` (root side first)."""
        table: list[int] = []
        for node in path:
            if not node.blocks:
                break  # the rest of the path is host-only
            if node.start % self.block_size:
                table.pop()  # block index shared with the parent: the deeper node wins
            table.extend(node.blocks)
        return table

    def _adopt(self, path: list[RadixNode], blocks: Sequence[int], priority: int) -> None:
        """A host-only node on the path takes the caller's blocks for its positions (the
        caller computed these tokens itself) and is on both tiers after."""
        super()._adopt(path, blocks, priority)
        bs = self.block_size
        for node in path:
            if not node.blocks:
                self._unlist(node)
                self._unlist(node.parent)
                node.blocks = list(blocks[node.start // bs : (node.end - 1) // bs + 1])
                self._hold(node, node.blocks)
                self.observer.stored(node, MEDIUM_GPU)
                self._relist(node.parent)
                self._relist(node)

    def _evict_leaf(self, leaf: RadixNode, num_blocks: int) -> int:
        """Write the whole leaf back to the host (no trimming: the host keeps all of it)."""
        return self._evict_to_host(leaf)

    def _clear(self) -> None:
        """The device leaves go with their host-only subtrees, then every host candidate."""
        super()._clear()
        while self._host_evictable:
            self.version += 1
            self._evict_host_one()

    def _drop(self, leaf: RadixNode) -> int:
        return self._remove_subtree(leaf)

    def _cut(self, node: RadixNode, k: int) -> RadixNode:
        """Both halves of a host copy too; a cut inside a block adds a host reference."""
        upper = super()._cut(node, k)
        bs, s, cut = self.block_size, upper.start, node.start
        upper.host_blocks = node.host_blocks[: (cut - 1) // bs - s // bs + 1]
        node.host_blocks = node.host_blocks[cut // bs - s // bs :]
        if cut % bs and upper.host_blocks:
            b = upper.host_blocks[-1]
            self.host.allocator.incref([b])
            self._host_refs[b] += 1
        return upper

    def _touch(self, node: RadixNode, stamp: int) -> None:
        if node.in_lru or node.in_host_lru:  # re-key in the sorted lists
            self._unlist(node)
            node.last_access = stamp
            self._relist(node)
        else:
            node.last_access = stamp

    def _unlist(self, node: RadixNode) -> None:
        super()._unlist(node)
        if node.in_host_lru:
            self._host_evictable.remove(node)
            node.in_host_lru = False

    def _relist(self, node: RadixNode) -> None:
        super()._relist(node)
        if not node.in_host_lru and is_host_candidate(node):
            self._host_evictable.add(node)
            node.in_host_lru = True

    def _check_node(self, node: RadixNode, num_blocks: int) -> None:
        assert node.blocks or node.host_blocks, "a node with KV on no tier"
        assert len(node.blocks) in (0, num_blocks) and len(node.host_blocks) in (0, num_blocks)
        assert not node.blocks or not node.parent.key or node.parent.blocks, (
            "a device node under a host-only node"
        )

    def check_integrity(self) -> None:
        """The base tree's checks, then the host reference counter, the host candidate list
        and the host allocator."""
        super().check_integrity()
        nodes = walk(self.roots)
        host_refs: Counter[int] = Counter()
        for node in nodes:
            host_refs.update(node.host_blocks)
        assert host_refs == self._host_refs, "host reference counter out of sync"
        candidates = {node.id for node in nodes if is_host_candidate(node)}
        check_candidates(self._host_evictable, candidates, "in_host_lru")
        # Host blocks are held by tree nodes only: the counts match exactly, and
        # free + cached == total (a queued SwapIn's source stays recorded by its node
        # or is rewritten only by a later op: the runner runs ops in order).
        alloc = self.host.allocator
        held = self._host_blocks_held()
        assert held.keys().isdisjoint(host_refs), "a host block both cached and held"
        alloc.check_integrity(host_refs + held)
        assert alloc.num_free + len(host_refs) + len(held) == alloc.num_blocks, "host blocks leaked"

    def _host_blocks_held(self) -> Counter[int]:
        """Layer hook: host blocks a layer below holds outside the tree (a transfer in
        flight), with their references."""
        return Counter()


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
