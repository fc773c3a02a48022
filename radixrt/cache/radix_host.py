"""The radix tree's host KV tier (a mixin of `RadixCache`, see `radixrt.cache.radix` for the
tiers' invariants): loading host-only nodes to the device, writing device leaves back, the host
tier's own eviction, and forgetting the copies of a failed step. Plain Python (no torch); the
swap ops collect in the `HostTier` outbox (`radixrt.cache.tiers`)."""

from __future__ import annotations

from radixrt.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU
from radixrt.cache.radix_node import RadixNode


class HostTierMixin:
    """Host-tier methods of `RadixCache`: they use its tree, allocators, counters and
    candidate lists (`_unlist` / `_relist` around every state change of a node)."""

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
        assert self.host is not None
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
            if self.events is not None:
                self.events.stored(node, MEDIUM_GPU)
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
                self._drop_host_copy(node)
            if node.id in off_device:
                dropped, node.blocks = node.blocks, []
                for b in dropped:
                    self._drop(self._refs, b)
                self.allocator.decref(dropped)
                if self.events is not None:
                    self.events.removed(node, MEDIUM_GPU)
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
        host = self.host
        assert host is not None and leaf.lock_ref == 0
        if not leaf.host_blocks:
            # An edge ending inside a block: a host-only child's copy of that block holds the
            # leaf's positions there too; share it (one reference, taken before allocating
            # may evict the child) instead of writing the block back again.
            shared = None
            if leaf.end % self.block_size:
                shared = next((c.host_blocks[0] for c in leaf.children.values()), None)
            if shared is not None:
                host.allocator.incref([shared])
            num_new = len(leaf.blocks) - (shared is not None)
            host_blocks = self._host_allocate(num_new)  # may relist `leaf`
            if host_blocks is None:
                if shared is not None:
                    host.allocator.decref([shared])
                freed = self._remove_subtree(leaf)
                host.stats.num_dropped_blocks += freed
                return freed
            self._unlist(leaf)
            host.write_back(leaf.blocks[:num_new], host_blocks)
            if shared is not None:
                host_blocks.append(shared)
            leaf.host_blocks = host_blocks  # one reference each: the node's
            for b in host_blocks:
                self._host_refs[b] += 1
            if self.events is not None:
                self.events.stored(leaf, MEDIUM_CPU)
        self._unlist(leaf)
        self._unlist(leaf.parent)
        dropped, leaf.blocks = leaf.blocks, []
        for b in dropped:
            self._drop(self._refs, b)
        if self.events is not None:
            self.events.removed(leaf, MEDIUM_GPU)
        self._relist(leaf)
        self._relist(leaf.parent)
        return self.allocator.decref(dropped)

    def _host_allocate(self, n: int) -> list[int] | None:
        """`n` fresh host blocks, evicting host entries for room (see `host_eviction_key`);
        None, evicting nothing, when `n` exceeds the host pool."""
        alloc = self.host.allocator
        if n > alloc.num_blocks:
            return None
        while alloc.num_free < n and self._host_evictable:
            self._evict_host_one()
        return alloc.allocate(n) if alloc.num_free >= n else None

    def _evict_host_one(self) -> None:
        """Evict the LRU host entry: a node on both tiers loses its host copy, a host-only
        leaf leaves the tree."""
        node = self._host_evictable.pop(0)
        node.in_host_lru = False
        if not node.blocks:
            assert node.lock_ref == 0 and not node.children
            parent = node.parent
            self._unlist(parent)
            del parent.children[node.key[0]]
            node.parent = None
            self._total_tokens -= len(node.key)
            self._relist(parent)
            self._prune_root(parent)
        self.host.stats.num_host_evicted_blocks += self._drop_host_copy(node)

    def _drop_host_copy(self, node: RadixNode) -> int:
        """Release the node's host blocks; returns host blocks freed."""
        dropped, node.host_blocks = node.host_blocks, []
        for b in dropped:
            self._drop(self._host_refs, b)
        if dropped and self.events is not None:
            self.events.removed(node, MEDIUM_CPU)
        return self.host.allocator.decref(dropped) if dropped else 0

    def _is_host_candidate(self, node: RadixNode) -> bool:
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
