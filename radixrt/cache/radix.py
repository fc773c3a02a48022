"""Token-level radix tree over reference-counted KV blocks (SGLang-style prefix cache).

Each edge is a run of tokens. A node records, for every block index its edge touches,
the block holding the KV of its tokens there: the token at absolute position p of the
node lives in its block for index p // B at offset p % B. Invariant (kept by the scheduler's
copy-on-write): the block recorded for p holds valid KV for positions
floor(p / B) * B .. p of the node's path. A node whose edge starts or ends inside a block
shares that block index with its parent or child; they may record the same block (after a
split, or a request inserting its progress twice) or different ones (branches that
diverged mid-block). Every node holds one reference on each block it records, so a block
recorded by two nodes carries two cache references (see `held_refs`).

This module is the base tree: tokens, LRU eviction, locks, priorities and namespaces, with
every node's KV on the device. Eviction takes LRU device leaves (unlocked, no child on the
device), trimming a long leaf's tail first. Tiers are layers over it (subclasses):
`radixrt.cache.radix_host.HostRadixCache` keeps copies of evicted nodes on the host. A layer
changes what the tree does through the hooks marked "layer hook" below and nothing else. What
the tree holds is reported, as it changes, to the `TreeObserver` given at construction (the KV
event recorder, `radixrt.cache.radix_events`).

Namespaces (tenants; `radixrt.cache.namespace`): the tree has one root per `CacheNamespace`
(the default namespace's root is `root`; another's is made by its first insert and dropped
when its last child leaves). The namespace is part of every key, so a walk never leaves its
subtree: requests of different namespaces share no node, hence no block on any tier, while
eviction stays one LRU over the whole pool. A root has an empty key and no blocks; every
other node has a non-empty key.

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
from typing import TYPE_CHECKING

from sortedcontainers import SortedKeyList

from radixrt.cache.base import CacheStats, InsertResult, MatchResult
from radixrt.cache.kv_events import MEDIUM_GPU
from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.cache.radix_check import check_tree
from radixrt.cache.radix_node import (
    NoObserver,
    RadixNode,
    TreeObserver,
    drop_ref,
    is_device_leaf,
)
from radixrt.kv.allocator import BlockAllocator

if TYPE_CHECKING:
    from radixrt.cache.tiers import KVTier


class RadixCache:
    """Prefix cache keyed by exact token prefixes; see `radixrt.cache.base` for ownership.

    `evictable_blocks` counts the distinct cached device blocks that no locked node records.
    It equals what `evict` would free if every unlocked node were evicted, provided every
    block a request holds that the tree also records lies on a path the request locked
    (the scheduler protocol: lock the match handle, lock each insert's handle at once).
    """

    mode = "radix"
    host: KVTier | None = None  # no host KV tier (`HostRadixCache` has one)

    def __init__(
        self, allocator: BlockAllocator, block_size: int, observer: TreeObserver | None = None
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        # told of every change to what the tree holds on each tier (KV events)
        self.observer: TreeObserver = observer if observer is not None else NoObserver()
        self.stats = CacheStats()
        self.version = 0  # bumped by every eviction or trim (match results go stale)
        self._ids = itertools.count()
        self._clock = 0
        self.root = RadixNode(next(self._ids), [], 0, [])  # the default namespace's root
        self._roots: dict[CacheNamespace, RadixNode] = {DEFAULT_NAMESPACE: self.root}
        self._root_namespaces: dict[int, CacheNamespace] = {}  # another root's id -> namespace
        # Device eviction candidates (unlocked non-root device leaves): the least urgent
        # priority (highest number) of the requests that inserted them first, LRU within one.
        self._evictable = SortedKeyList(key=lambda n: (-n.priority, n.last_access, n.id))
        self._refs: Counter[int] = Counter()  # device block -> nodes recording it
        self._locked_refs: Counter[int] = Counter()  # device block -> locked nodes recording it
        self._total_tokens = 0

    # ---- queries -------------------------------------------------------------------

    def match(
        self, tokens: Sequence[int], namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> MatchResult:
        """Longest cached prefix of `tokens` (token-exact) in `namespace`, on any tier.
        Splits a node when the match ends inside an edge, so the handle ends exactly at the
        match; refreshes access times along the path. Takes no references for the caller; a
        split inside a block adds the cache's reference for the second node recording it
        (see base.py)."""
        tokens = list(tokens)
        top = self._root_of(namespace, create=False)
        path, pos = self._walk(tokens, top)
        return self._match_result(path, pos, path[-1] if path else top)

    def _root_of(self, namespace: CacheNamespace, create: bool) -> RadixNode:
        """The root of `namespace`'s subtree (made when `create`; otherwise a fresh empty node
        that is not in the tree stands for a namespace nothing was cached in)."""
        top = self._roots.get(namespace)
        if top is None:
            top = RadixNode(next(self._ids), [], 0, [])
            if create:
                self._roots[namespace] = top
                self._root_namespaces[top.id] = namespace
        return top

    @property
    def roots(self) -> list[RadixNode]:
        """The default namespace's root, then one root per namespace with cached entries."""
        return list(self._roots.values())

    def peek_continuation(
        self, tokens: Sequence[int], max_tokens: int, namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> list[int]:
        """Up to `max_tokens` cached tokens that follow `tokens` in `namespace`, when all of
        `tokens` is cached ([] otherwise, and for empty `tokens`): the rest of the edge the
        walk ends in, then down the most recently used child at each node. Read-only:
        splits no node, refreshes no access time, takes no reference and counts nothing
        (speculative drafts read it every decode step)."""
        if not tokens or max_tokens <= 0:
            return []
        tokens = list(tokens)
        node = self._root_of(namespace, create=False)
        pos, offset = 0, 0  # offset: tokens of node.key consumed
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
        return 0

    @property
    def total_tokens(self) -> int:
        """Tokens stored in the tree, on any tier (= distinct cached non-empty prefixes)."""
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

    # ---- locking -------------------------------------------------------------------

    def lock(self, handle: RadixNode) -> None:
        """Protect the path root..handle from eviction on every tier (nestable)."""
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
        namespace: CacheNamespace = DEFAULT_NAMESPACE,
        priority: int = 0,
    ) -> InsertResult:
        """Cache `tokens` whose KV is in `blocks` (position p in blocks[p // B]) in
        `namespace`; the nodes of the path take `priority` (eviction takes the highest first).

        Cached tokens keep their blocks; the uncached tail becomes one new leaf that takes a
        reference on each block it records. Returns the node ending at len(tokens) (split if
        needed; the namespace's root for no tokens): lock it before anything can evict."""
        tokens = list(tokens)
        n, bs = len(tokens), self.block_size
        assert len(blocks) >= -(-n // bs), f"{len(blocks)} blocks cannot hold {n} tokens"
        top = self._root_of(namespace, create=bool(tokens))
        path, pos = self._walk(tokens, top)
        self._adopt(path, blocks, priority)
        node = path[-1] if path else top
        num_new = n - pos
        if num_new:
            leaf = RadixNode(
                next(self._ids), tokens[pos:], pos, list(blocks[pos // bs : (n - 1) // bs + 1])
            )
            leaf.last_access = self._clock
            leaf.priority = priority
            self._attach(node, leaf, namespace)
            node = leaf
        self.stats.num_inserted_tokens += num_new
        return InsertResult(node, num_new)

    def evict(self, num_blocks: int) -> int:
        """Evict least recently used unlocked device leaves until `num_blocks` device blocks
        became free in the allocator or nothing is evictable (what happens to a leaf:
        `_evict_leaf`). Returns the device blocks freed."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        freed = 0
        while freed < num_blocks and self._evictable:
            self.version += 1
            leaf = self._evictable.pop(0)
            leaf.in_lru = False
            freed += self._evict_leaf(leaf, num_blocks - freed)
        self.stats.num_evicted_blocks += freed
        return freed

    def reset(self) -> None:
        """Remove every unlocked node, on every tier (locked paths stay)."""
        self.observer.reset_started()
        self._clear()
        self.observer.reset_done()

    # ---- layer hooks (a tier layer overrides these; see the module docstring) -----------

    def _match_result(self, path: list[RadixNode], pos: int, node: RadixNode) -> MatchResult:
        """Layer hook: the MatchResult of a walk that matched `pos` tokens along `path`,
        ending at `node`."""
        return MatchResult(self._table(path), pos, node)

    def _table(self, path: list[RadixNode]) -> list[int]:
        """Layer hook: the device block table of `path` (root side first)."""
        table: list[int] = []
        for node in path:
            if node.start % self.block_size:
                table.pop()  # block index shared with the parent: the deeper node wins
            table.extend(node.blocks)
        return table

    def _adopt(self, path: list[RadixNode], blocks: Sequence[int], priority: int) -> None:
        """Layer hook: the cached nodes of an insert's `path` (whose KV is also in the
        caller's `blocks`) take the inserting request's `priority`."""
        for node in path:
            if node.priority != priority:
                self._unlist(node)
                node.priority = priority
                self._relist(node)

    def _evict_leaf(self, leaf: RadixNode, num_blocks: int) -> int:
        """Layer hook: free the device blocks of an unlisted, unlocked device leaf that
        `evict` took, `num_blocks` of them wanted: trim its tail when that suffices, else
        remove it. Returns device blocks freed."""
        trimmed = self._trim_leaf(leaf, num_blocks)
        return self._remove_leaf(leaf) if trimmed is None else trimmed

    def _clear(self) -> None:
        """Layer hook: `reset`'s removals (every unlocked device leaf, until none is left)."""
        freed = 0
        while self._evictable:
            self.version += 1
            leaf = self._evictable.pop(0)
            leaf.in_lru = False
            freed += self._drop(leaf)
        self.stats.num_evicted_blocks += freed

    def _drop(self, leaf: RadixNode) -> int:
        """Layer hook: take an unlisted, unlocked device leaf and what hangs below it out of
        the tree; returns device blocks freed."""
        return self._remove_leaf(leaf)

    def _cut(self, node: RadixNode, k: int) -> RadixNode:
        """Layer hook: cut node's edge after k tokens (0 < k < len(key)); returns the new upper
        node, not listed yet. `node` keeps its identity (handles to it stay valid) as the
        lower half. If the cut falls inside a block, both halves record that block: one more
        reference."""
        bs, s = self.block_size, node.start
        cut = s + k
        num_upper = (cut - 1) // bs - s // bs + 1  # block indices of the upper half
        upper = RadixNode(next(self._ids), node.key[:k], s, node.blocks[:num_upper])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.priority = node.priority
        upper.parent = node.parent
        upper.children = {node.key[k]: node}
        node.parent.children[node.key[0]] = upper
        node.parent = upper
        node.blocks = node.blocks[cut // bs - s // bs :]
        node.key = node.key[k:]
        node.start = cut
        if cut % bs:
            self._hold(upper, upper.blocks[-1:])
        self.observer.split(upper, node)
        return upper

    def _touch(self, node: RadixNode, stamp: int) -> None:
        """Layer hook: set node's access time, re-keying it in the candidate lists."""
        if node.in_lru:
            self._unlist(node)
            node.last_access = stamp
            self._relist(node)
        else:
            node.last_access = stamp

    def _unlist(self, node: RadixNode) -> None:
        """Layer hook: take `node` off the candidate lists (before changing its state or
        access time)."""
        if node.in_lru:
            self._evictable.remove(node)
            node.in_lru = False

    def _relist(self, node: RadixNode) -> None:
        """Layer hook: put `node` on the candidate lists it belongs to and is not on yet."""
        if not node.in_lru and is_device_leaf(node):
            self._evictable.add(node)
            node.in_lru = True

    def _check_node(self, node: RadixNode, num_blocks: int) -> None:
        """Layer hook: assert where a non-root node's KV lives (`num_blocks`: the block
        indices its edge touches)."""
        assert len(node.blocks) == num_blocks and not node.host_blocks, "KV off the device"

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
                child = self._cut(child, k)
                self._relist(child)  # on a tier it may be a candidate; never a device leaf
            self._touch(child, self._clock)
            path.append(child)
            node, pos = child, pos + k
        return path, pos

    def _path(self, handle: RadixNode) -> list[RadixNode]:
        """Nodes root..handle, root excluded, root side first."""
        path = []
        node = handle
        while node.key:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _hold(self, node: RadixNode, blocks: Sequence[int]) -> None:
        """Record that `node` holds a reference on each of `blocks` (device)."""
        self.allocator.incref(blocks)
        for b in blocks:
            self._refs[b] += 1
            if node.lock_ref:
                self._locked_refs[b] += 1

    def _release(self, node: RadixNode) -> int:
        """Drop node's device blocks (it leaves the device); returns blocks freed."""
        dropped, node.blocks = node.blocks, []
        for b in dropped:
            drop_ref(self._refs, b)
        self.observer.removed(node, MEDIUM_GPU)
        return self.allocator.decref(dropped)

    def _attach(self, parent: RadixNode, leaf: RadixNode, namespace: CacheNamespace) -> None:
        self._unlist(parent)
        parent.children[leaf.key[0]] = leaf
        leaf.parent = parent
        self._hold(leaf, leaf.blocks)
        self._total_tokens += len(leaf.key)
        self.observer.added(leaf, namespace)
        self._relist(leaf)
        self._relist(parent)

    def _detach(self, node: RadixNode) -> None:
        """Take a childless, unlisted, unlocked node out of the tree (its blocks stay)."""
        assert node.lock_ref == 0 and not node.children
        parent = node.parent
        self._unlist(parent)
        del parent.children[node.key[0]]
        node.parent = None
        self._total_tokens -= len(node.key)
        self._relist(parent)
        if not parent.key and not parent.children and parent.id in self._root_namespaces:
            del self._roots[self._root_namespaces.pop(parent.id)]  # no memory per namespace

    def _trim_leaf(self, node: RadixNode, num_blocks: int) -> int | None:
        """Evict only the tail of an (already unlisted) unlocked leaf: its last
        `num_blocks` blocks, when the leaf keeps at least one token and its first block.
        The shortened leaf goes back on the evictable list. Returns blocks freed, or None
        when the leaf is too short to trim (evict it whole). Like block-hash LRU, which frees a
        sequence's tail blocks first, this keeps the still-useful head of a long leaf."""
        bs, first = self.block_size, node.start // self.block_size
        keep = len(node.blocks) - num_blocks  # blocks the leaf keeps
        if keep < 1 or (first + keep) * bs <= node.start:
            return None
        dropped = node.blocks[keep:]
        del node.blocks[keep:]
        new_len = (first + keep) * bs - node.start
        self.observer.trimmed(node, keep)
        self._total_tokens -= len(node.key) - new_len
        del node.key[new_len:]
        for b in dropped:
            drop_ref(self._refs, b)
        self._relist(node)
        return self.allocator.decref(dropped)

    def _remove_leaf(self, node: RadixNode) -> int:
        """Take an unlisted, unlocked device leaf out of the tree; returns device blocks freed."""
        self._detach(node)
        return self._release(node)

    # ---- checks --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert tree shape, lock counts, reference counters, the candidate list
        (`radixrt.cache.radix_check.check_tree`) and the observer's view of the tree."""
        check_tree(
            self.roots,
            self.block_size,
            self.allocator,
            self._refs,
            self._locked_refs,
            self._total_tokens,
            self._evictable,
            self._check_node,
        )
        self.observer.check_integrity(self.roots)

    def flush_salts(self, salts: Callable[[str | None], bool]) -> int:
        """Remove the unlocked device leaves of the namespaces whose salt `salts` accepts, and
        what hangs below them, until none is left (host-only entries of those salts age out);
        returns the device blocks freed."""
        freed = 0
        while leaves := [n for n in self._evictable if salts(self._namespace_of(n).salt)]:
            for leaf in leaves:
                self.version += 1
                self._unlist(leaf)
                freed += self._drop(leaf)
        self.stats.num_evicted_blocks += freed
        return freed

    def _namespace_of(self, node: RadixNode) -> CacheNamespace:
        while node.parent is not None:
            node = node.parent
        return self._root_namespaces.get(node.id, DEFAULT_NAMESPACE)


def _common_prefix_len(key: list[int], tokens: list[int], pos: int) -> int:
    """Length of the common prefix of `key` and tokens[pos:]."""
    seg = tokens[pos : pos + len(key)]
    if seg == key:
        return len(key)
    for i, (a, b) in enumerate(zip(key, seg)):
        if a != b:
            return i
    return len(seg)
