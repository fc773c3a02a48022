"""Token-level radix tree over reference-counted KV blocks (SGLang-style prefix cache).

Each edge is a run of tokens. A node records, for every block index its edge touches,
the block holding the KV of its tokens there: the token at absolute position p of the
node lives in `node.block_at(p)` at offset p % B. Invariant (kept by the scheduler's
copy-on-write): the block recorded for p holds valid KV for positions
floor(p / B) * B .. p of the node's path. A node whose edge starts or ends inside a block
shares that block index with its parent or child; they may record the same block (after a
split, or a request inserting its progress twice) or different ones (branches that
diverged mid-block). Every node holds one reference on each block it records, so a block
recorded by two nodes carries two cache references (see `held_refs`).

Host tier (optional `HostTier`, see `radixrt.cache.tiers`): a node's KV is on the device
(`blocks`), on the host (`host_blocks`), or both; an empty list means "not in that tier". The
nodes on the device form a subtree containing the root (a device node's parent is on the
device), so a path runs device nodes first, then host-only ones. Device eviction takes LRU
device leaves (unlocked, no child on the device) and writes their blocks back to the host
(a SwapOut op per block; none when the node already has a host copy) instead of removing
them; only when the host cannot make room is the leaf removed with its host-only subtree.
The host tier evicts for real: host copies of nodes that are on the device too first (that
loses no KV; most recently used first), then host-only leaves (LRU first), which leave the tree.
`match` counts host-resident tokens as cached (`num_host_tokens`); `load(handle)` brings them
into fresh device blocks (SwapIn ops). A block index shared by a parent and its child (an
edge ending inside a block) moves once: the parent's write-back shares its host-only child's
copy of that block, and a load of both loads the deeper node's copy once for both. Locking
covers both tiers: a locked host-only node is never evicted. After a failed step,
`discard_copies` forgets the copies its swap ops may not have made. The cache owns the tree,
the device blocks and counters and the device candidate list; its host-tier component
(`RadixHostTier`, `radixrt.cache.radix_host`) owns the `HostTier`, the host reference counter
and the host candidate list. Without a host tier the tree behaves as before (a long leaf's
tail is trimmed first).

Cache salt (tenants): the tree has one root per salt (`salt=None`: the unsalted root `root`;
a salted root is made by its first insert and dropped when its last child leaves). The salt
is part of every key, so a walk never leaves its salt's subtree: requests with different
salts share no node, hence no block on either tier, while eviction stays one LRU over the
whole pool. A root has an empty key and no blocks; every other node has a non-empty key.

Complexity (n = query tokens, d = nodes on the path, m = blocks of the result):
- match: O(d + m) plus C-level list comparisons of the edges; at most one split.
- insert: O(d + new tokens / B); at most one split and one new leaf.
- lock / unlock: O(d) plus O(blocks) of the nodes whose lock state flips.
- evict: O(log N) per removed leaf (N = evictable leaves) plus its blocks.
- evictable_blocks, cached_blocks, total_tokens: O(1).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence

from sortedcontainers import SortedKeyList

from radixrt.cache.base import CacheStats, InsertResult, MatchResult
from radixrt.cache.kv_events import MEDIUM_GPU
from radixrt.cache.radix_check import check_tree, format_tree
from radixrt.cache.radix_events import RadixEventRecorder
from radixrt.cache.radix_host import RadixHostTier
from radixrt.cache.radix_node import RadixNode, drop_ref, is_device_leaf
from radixrt.cache.tiers import HostTier
from radixrt.kv.allocator import BlockAllocator


class RadixCache:
    """Prefix cache keyed by exact token prefixes; see `radixrt.cache.base` for ownership.

    `evictable_blocks` counts the distinct cached device blocks that no locked node records.
    It equals what `evict` would free if every unlocked node were evicted, provided every
    block a request holds that the tree also records lies on a path the request locked
    (the scheduler protocol: lock the match handle, lock each insert's handle at once).
    """

    mode = "radix"

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        host: HostTier | None = None,
        events: RadixEventRecorder | None = None,
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        # KV events (radixrt.cache.radix_events): told of every change to the set of full
        # blocks held on each tier; None: off
        self.events = events
        if events is not None:
            events.salt_of = self.salt_of
        # the host KV tier's bookkeeping (owns `host`), or None: no host tier
        self.host_tier = RadixHostTier(host, events) if host is not None else None
        self.stats = CacheStats()
        self.version = 0  # bumped by every eviction or trim (match results go stale)
        self._ids = itertools.count()
        self._clock = 0
        self.root = RadixNode(next(self._ids), [], 0, [])  # the unsalted root
        self._salt_roots: dict[str, RadixNode] = {}  # cache salt -> its root
        self._root_salts: dict[int, str] = {}  # a salted root's node id -> its salt
        # Device eviction candidates (unlocked non-root device leaves): the least urgent
        # priority (highest number) of the requests that inserted them first, LRU within one.
        self._evictable = SortedKeyList(key=lambda n: (-n.priority, n.last_access, n.id))
        self._refs: Counter[int] = Counter()  # device block -> nodes recording it
        self._locked_refs: Counter[int] = Counter()  # device block -> locked nodes recording it
        self._total_tokens = 0

    # ---- queries -------------------------------------------------------------------

    def match(self, tokens: Sequence[int], salt: str | None = None) -> MatchResult:
        """Longest cached prefix of `tokens` (token-exact) under `salt`, on either tier.
        Splits a node when the match ends inside an edge, so the handle ends exactly at the
        match; refreshes access times along the path. Takes no references for the caller; a
        split inside a block adds the cache's reference for the second node recording it
        (see base.py).
        `blocks` cover the device-resident part; `num_host_tokens` tokens follow on the host
        only (`load` brings them to the device)."""
        tokens = list(tokens)
        top = self._root_of(salt, create=False)
        path, pos = self._walk(tokens, top)
        node = path[-1] if path else top
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

    def _root_of(self, salt: str | None, create: bool) -> RadixNode:
        """The root of `salt`'s subtree (made when `create`; otherwise a fresh empty node
        that is not in the tree stands for a salt nothing was cached under)."""
        if salt is None:
            return self.root
        top = self._salt_roots.get(salt)
        if top is None:
            top = RadixNode(next(self._ids), [], 0, [])
            if create:
                self._salt_roots[salt] = top
                self._root_salts[top.id] = salt
        return top

    def salt_of(self, handle: RadixNode) -> str | None:
        """The cache salt of the subtree the live node `handle` lies in (None: unsalted)."""
        node = handle
        while node.key:
            node = node.parent
        return self._root_salts.get(node.id)

    @property
    def host(self) -> HostTier | None:
        """The host KV tier (allocator, swap op outbox, counters), or None."""
        return self.host_tier.host if self.host_tier is not None else None

    @property
    def roots(self) -> list[RadixNode]:
        """The unsalted root, then one root per salt with cached entries."""
        return [self.root, *self._salt_roots.values()]

    def _prune_root(self, node: RadixNode) -> None:
        """Drop a salted root left without children (no memory per forgotten salt)."""
        if not node.key and not node.children and node.id in self._root_salts:
            del self._salt_roots[self._root_salts.pop(node.id)]

    def _path(self, handle: RadixNode) -> list[RadixNode]:
        """Nodes root..handle, root excluded, root side first."""
        path = []
        node = handle
        while node.key:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def peek_continuation(
        self, tokens: Sequence[int], max_tokens: int, salt: str | None = None
    ) -> list[int]:
        """Up to `max_tokens` cached tokens that follow `tokens` under `salt`, when all of
        `tokens` is cached ([] otherwise, and for empty `tokens`): the rest of the edge the
        walk ends in, then down the most recently used child at each node. Read-only:
        splits no node, refreshes no access time, takes no reference and counts nothing
        (speculative drafts read it every decode step)."""
        if not tokens or max_tokens <= 0:
            return []
        tokens = list(tokens)
        node, pos, offset = (
            self._root_of(salt, create=False),
            0,
            0,
        )  # offset: tokens of node.key consumed
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                return []
            k = _common_prefix_len(child.key, tokens, pos)
            if k < len(child.key) and pos + k < len(tokens):
                return []  # diverges inside the edge
            node, pos, offset = child, pos + k, k
        out = node.key[offset : offset + max_tokens]
        while len(out) < max_tokens and node.children:
            node = max(node.children.values(), key=lambda c: (c.last_access, c.id))
            out += node.key[: max_tokens - len(out)]
        return out

    @property
    def evictable_blocks(self) -> int:
        """Distinct cached device blocks recorded by no locked node (see the class docstring)."""
        return len(self._refs) - len(self._locked_refs)

    @property
    def cached_blocks(self) -> int:
        """Distinct device blocks the tree holds a reference on."""
        return len(self._refs)

    @property
    def host_cached_blocks(self) -> int:
        """Distinct host blocks the tree holds a reference on (0 without a host tier)."""
        return self.host_tier.num_cached_blocks if self.host_tier is not None else 0

    @property
    def total_tokens(self) -> int:
        """Tokens stored in the tree, on either tier (= distinct cached non-empty prefixes)."""
        return self._total_tokens

    def held_refs(self) -> Counter[int]:
        """Device block -> references held by the tree (one per node recording the block)."""
        return Counter(self._refs)

    def locked_blocks(self, handle: RadixNode) -> list[int]:
        """Distinct device blocks recorded by the nodes of the path root..handle."""
        blocks: dict[int, None] = {}
        node = handle
        while node.key:
            blocks.update(dict.fromkeys(node.blocks))
            node = node.parent
        return list(blocks)

    def prefix_boundaries(self, handle: RadixNode) -> list[int]:
        """Where the nodes of the path root..handle begin (token counts, ascending, > 0)."""
        starts = []
        node = handle
        while node.parent is not None:
            starts.append(node.start)
            node = node.parent
        return sorted(s for s in starts if s > 0)

    def take_swap_ops(self) -> list:
        """Swap ops made since the last call, in order ([] without a host tier)."""
        return self.host_tier.take_ops() if self.host_tier is not None else []

    # ---- locking -------------------------------------------------------------------

    def lock(self, handle: RadixNode) -> None:
        """Protect the path root..handle from eviction on both tiers (nestable)."""
        assert not handle.key or handle.parent is not None, "lock of an evicted node"
        node = handle
        while node.key:
            if node.lock_ref == 0:
                self._unlist(node)
                for b in node.blocks:
                    self._locked_refs[b] += 1
                node.lock_ref += 1
                self._relist(node)
            else:
                node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: RadixNode) -> None:
        """Undo one `lock(handle)`."""
        node = handle
        while node.key:
            assert node.lock_ref > 0, "unlock without lock"
            if node.lock_ref == 1:
                self._unlist(node)
                node.lock_ref = 0
                for b in node.blocks:
                    drop_ref(self._locked_refs, b)
                self._relist(node)
            else:
                node.lock_ref -= 1
            node = node.parent

    # ---- mutation ------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        blocks: Sequence[int],
        salt: str | None = None,
        priority: int = 0,
    ) -> InsertResult:
        """Cache `tokens` whose KV is in `blocks` (position p in blocks[p // B]) under `salt`;
        the nodes of the path take `priority` (eviction takes the highest first).

        Cached tokens keep their blocks (a host-only node on the path takes the caller's
        blocks for its positions and is on both tiers after); the uncached tail becomes one
        new leaf that takes a reference on each block it records. Returns the node ending at
        len(tokens) (split if needed; the root for no tokens): lock it before anything
        can evict (the salt's root for no tokens)."""
        tokens = list(tokens)
        n, bs = len(tokens), self.block_size
        assert len(blocks) >= -(-n // bs), f"{len(blocks)} blocks cannot hold {n} tokens"
        top = self._root_of(salt, create=bool(tokens))
        path, pos = self._walk(tokens, top)
        for node in path:
            if node.priority != priority:
                self._unlist(node)
                node.priority = priority
                self._relist(node)
            if not node.blocks:  # host-only: the caller computed these tokens itself
                self._unlist(node)
                self._unlist(node.parent)
                node.blocks = list(blocks[node.start // bs : (node.end - 1) // bs + 1])
                self._hold(node, node.blocks)
                if self.events is not None:
                    self.events.stored(node, MEDIUM_GPU)
                self._relist(node.parent)
                self._relist(node)
        node = path[-1] if path else top
        num_new = n - pos
        if num_new:
            leaf = RadixNode(
                next(self._ids), tokens[pos:], pos, list(blocks[pos // bs : (n - 1) // bs + 1])
            )
            leaf.last_access = self._clock
            leaf.priority = priority
            self._attach(node, leaf)
            node = leaf
        self.stats.num_inserted_tokens += num_new
        return InsertResult(node, num_new)

    def evict(self, num_blocks: int) -> int:
        """Evict least recently used unlocked device leaves until `num_blocks` device blocks
        became free in the allocator or nothing is evictable. With a host tier a leaf is
        written back (it stays in the tree, host-only) unless the host cannot make room.
        Returns the device blocks freed."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        freed = 0
        while freed < num_blocks and self._evictable:
            self.version += 1
            leaf = self._evictable.pop(0)
            leaf.in_lru = False
            if self.host_tier is not None:
                freed += self._evict_to_host(leaf)
                continue
            trimmed = self._trim_leaf(leaf, num_blocks - freed)
            freed += self._remove_leaf(leaf) if trimmed is None else trimmed
        self.stats.num_evicted_blocks += freed
        return freed

    def reset(self) -> None:
        """Remove every unlocked node, on both tiers (locked paths stay)."""
        if self.events is not None:
            self.events.reset_started()
        freed = 0
        while self._evictable:
            self.version += 1
            leaf = self._evictable.pop(0)
            leaf.in_lru = False
            freed += self._remove_subtree(leaf)
        while self.host_tier is not None and self.host_tier.evictable:
            self.version += 1
            self._evict_host_one()
        self.stats.num_evicted_blocks += freed
        if self.events is not None:
            self.events.reset_done()

    # ---- host tier (moves between the tiers; the bookkeeping is `self.host_tier`'s) ----

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
        tier = self.host_tier
        assert tier is not None
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
        tier.load(list(source.values()), list(fresh.values()))
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
        tier = self.host_tier
        assert tier is not None
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
                tier.drop_copy(node)
            if node.id in off_device:
                dropped, node.blocks = node.blocks, []
                for b in dropped:
                    drop_ref(self._refs, b)
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
        tier = self.host_tier
        assert tier is not None and leaf.lock_ref == 0
        if not leaf.host_blocks:
            # An edge ending inside a block: a host-only child's copy of that block holds the
            # leaf's positions there too; share it (one reference, taken before allocating
            # may evict the child) instead of writing the block back again.
            shared = None
            if leaf.end % self.block_size:
                shared = next((c.host_blocks[0] for c in leaf.children.values()), None)
            if shared is not None:
                tier.host.allocator.incref([shared])
            num_new = len(leaf.blocks) - (shared is not None)
            host_blocks = self._host_allocate(num_new)  # may relist `leaf`
            if host_blocks is None:
                if shared is not None:
                    tier.host.allocator.decref([shared])
                freed = self._remove_subtree(leaf)
                tier.host.stats.num_dropped_blocks += freed
                return freed
            self._unlist(leaf)
            if shared is not None:
                host_blocks.append(shared)
            tier.write_back(leaf, leaf.blocks[:num_new], host_blocks)
        self._unlist(leaf)
        self._unlist(leaf.parent)
        dropped, leaf.blocks = leaf.blocks, []
        for b in dropped:
            drop_ref(self._refs, b)
        if self.events is not None:
            self.events.removed(leaf, MEDIUM_GPU)
        self._relist(leaf)
        self._relist(leaf.parent)
        return self.allocator.decref(dropped)

    def _host_allocate(self, n: int) -> list[int] | None:
        """`n` fresh host blocks, evicting host entries for room (in
        `radixrt.cache.radix_host.host_eviction_key` order);
        None, evicting nothing, when `n` exceeds the host pool."""
        tier = self.host_tier
        assert tier is not None
        alloc = tier.host.allocator
        if n > alloc.num_blocks:
            return None
        while alloc.num_free < n and tier.evictable:
            self._evict_host_one()
        return alloc.allocate(n) if alloc.num_free >= n else None

    def _evict_host_one(self) -> None:
        """Evict the first host candidate: a node on both tiers loses its host copy, a
        host-only leaf leaves the tree."""
        tier = self.host_tier
        assert tier is not None
        node = tier.pop_lru()
        if not node.blocks:
            assert node.lock_ref == 0 and not node.children
            parent = node.parent
            self._unlist(parent)
            del parent.children[node.key[0]]
            node.parent = None
            self._total_tokens -= len(node.key)
            self._relist(parent)
            self._prune_root(parent)
        tier.host.stats.num_host_evicted_blocks += tier.drop_copy(node)

    # ---- removal and the candidate lists ---------------------------------------------------

    def _remove_subtree(self, top: RadixNode) -> int:
        """Remove an unlocked device leaf (already unlisted) and every (host-only) node below
        it; returns device blocks freed."""
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
            self.host_tier.drop_copy(node)
        top.children = {}
        self._unlist(top)
        if top.host_blocks:
            self.host_tier.drop_copy(top)
        return self._remove_leaf(top)

    def _unlist(self, node: RadixNode) -> None:
        """Take `node` off both candidate lists (before changing its state or access time)."""
        if node.in_lru:
            self._evictable.remove(node)
            node.in_lru = False
        if node.in_host_lru:
            self.host_tier.unlist(node)

    def _relist(self, node: RadixNode) -> None:
        """Put `node` on the candidate lists it belongs to and is not on yet."""
        if not node.in_lru and is_device_leaf(node):
            self._evictable.add(node)
            node.in_lru = True
        if not node.in_host_lru and node.host_blocks:
            self.host_tier.relist(node)

    # ---- internals -----------------------------------------------------------------

    def _walk(self, tokens: list[int], top: RadixNode) -> tuple[list[RadixNode], int]:
        """Nodes below the root `top` on the path of the longest cached prefix of `tokens`
        and its length. The last node is split to end exactly there; all are stamped with a
        new clock."""
        self._clock += 1
        path: list[RadixNode] = []
        node, pos = top, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common_prefix_len(child.key, tokens, pos)
            if k < len(child.key):
                child = self._split(child, k)
            self._touch(child, self._clock)
            path.append(child)
            node, pos = child, pos + k
        return path, pos

    def _touch(self, node: RadixNode, stamp: int) -> None:
        if node.in_lru or node.in_host_lru:  # re-key in the sorted lists
            self._unlist(node)
            node.last_access = stamp
            self._relist(node)
        else:
            node.last_access = stamp

    def _hold(self, node: RadixNode, blocks: Sequence[int]) -> None:
        """Record that `node` holds a reference on each of `blocks` (device)."""
        self.allocator.incref(blocks)
        for b in blocks:
            self._refs[b] += 1
            if node.lock_ref:
                self._locked_refs[b] += 1

    def _attach(self, parent: RadixNode, leaf: RadixNode) -> None:
        self._unlist(parent)
        parent.children[leaf.key[0]] = leaf
        leaf.parent = parent
        self._hold(leaf, leaf.blocks)
        self._total_tokens += len(leaf.key)
        if self.events is not None:
            self.events.added(leaf)
        self._relist(leaf)
        self._relist(parent)

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut node's edge after k tokens (0 < k < len(key)); returns the new upper node.

        `node` keeps its identity (handles to it stay valid) as the lower half. If the
        cut falls inside a block, both halves record that block (on each tier the node is
        on): one more reference."""
        bs, s = self.block_size, node.start
        cut = s + k
        num_upper = (cut - 1) // bs - s // bs + 1  # block indices of the upper half
        upper = RadixNode(next(self._ids), node.key[:k], s, node.blocks[:num_upper])
        upper.host_blocks = node.host_blocks[:num_upper]
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.priority = node.priority
        upper.parent = node.parent
        upper.children = {node.key[k]: node}
        node.parent.children[node.key[0]] = upper
        node.parent = upper
        first_lower = cut // bs - s // bs
        node.blocks = node.blocks[first_lower:]
        node.host_blocks = node.host_blocks[first_lower:]
        node.key = node.key[k:]
        node.start = cut
        if node.block_hashes is not None:  # the full blocks ending before the cut go up
            num_up = cut // bs - s // bs
            upper.block_hashes = node.block_hashes[:num_up]
            node.block_hashes = node.block_hashes[num_up:]
        if cut % bs:
            if upper.blocks:
                self._hold(upper, [upper.blocks[-1]])
            if upper.host_blocks:
                self.host_tier.hold_split(upper)
        self._relist(upper)  # on both tiers it may be a host candidate; never a leaf
        return upper

    def _trim_leaf(self, node: RadixNode, num_blocks: int) -> int | None:
        """Evict only the tail of an (already unlisted) unlocked leaf: its last
        `num_blocks` blocks, when the leaf keeps at least one token and its first block.
        The shortened leaf goes back on the evictable list. Returns blocks freed, or None
        when the leaf is too short to trim (evict it whole). Like block-hash LRU, which frees a
        sequence's tail blocks first, this keeps the still-useful head of a long leaf.
        Only without a host tier."""
        bs, first = self.block_size, node.start // self.block_size
        keep = len(node.blocks) - num_blocks  # blocks the leaf keeps
        if keep < 1 or (first + keep) * bs <= node.start:
            return None
        dropped = node.blocks[keep:]
        del node.blocks[keep:]
        new_len = (first + keep) * bs - node.start
        if self.events is not None:
            self.events.removed(node, MEDIUM_GPU, keep=keep)
            del node.block_hashes[keep:]
        self._total_tokens -= len(node.key) - new_len
        del node.key[new_len:]
        for b in dropped:
            drop_ref(self._refs, b)
        self._relist(node)
        return self.allocator.decref(dropped)

    def _remove_leaf(self, node: RadixNode) -> int:
        """Detach an (already unlisted) unlocked leaf; returns device blocks freed."""
        assert node.lock_ref == 0 and not node.children and not node.host_blocks
        parent = node.parent
        self._unlist(parent)
        del parent.children[node.key[0]]
        node.parent = None
        self._total_tokens -= len(node.key)
        for b in node.blocks:
            drop_ref(self._refs, b)
        if self.events is not None and node.blocks:  # (discard_copies may have dropped them)
            self.events.removed(node, MEDIUM_GPU)
        self._relist(parent)
        self._prune_root(parent)
        return self.allocator.decref(node.blocks)

    # ---- checks and printing ---------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert tree shape, tier residency, lock counts, reference counters (both tiers)
        and the candidate lists (`radixrt.cache.radix_check.check_tree`)."""
        check_tree(
            self.roots,
            self.block_size,
            self.allocator,
            self._refs,
            self._locked_refs,
            self._total_tokens,
            self._evictable,
            self.host_tier,
            self.events,
        )

    def format_tree(self) -> str:
        """One line per node: tokens, position range, blocks, lock_ref, last_access."""
        return format_tree(self.roots, self.salt_of, self._total_tokens, self.cached_blocks)

    def pretty_print(self) -> None:
        print(self.format_tree())

    def flush_salts(self, salts: Callable[[str | None], bool]) -> int:
        """Remove the unlocked device leaves under the salts `salts` accepts, and what hangs
        below them, until none is left (host-only entries of those salts age out); returns the
        device blocks freed."""
        freed = 0
        while leaves := [leaf for leaf in self._evictable if salts(self.salt_of(leaf))]:
            for leaf in leaves:
                self.version += 1
                self._unlist(leaf)
                freed += self._remove_subtree(leaf)
        self.stats.num_evicted_blocks += freed
        return freed


def _common_prefix_len(key: list[int], tokens: list[int], pos: int) -> int:
    """Length of the common prefix of `key` and tokens[pos:]."""
    seg = tokens[pos : pos + len(key)]
    if seg == key:
        return len(key)
    for i, (a, b) in enumerate(zip(key, seg)):
        if a != b:
            return i
    return len(seg)
