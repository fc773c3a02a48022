"""KV events of the radix tree: which full blocks it holds on each tier, as vLLM events.

What is stored: a node owns the full blocks whose last token lies on its edge, block indices
start // B .. end // B - 1 (a block that ends inside a child's edge belongs to the child; an
edge inside one block owns none). The tree holds a full block on the device when the node
owning it is on the device (its recorded block holds the whole block's KV: the tree's
copy-on-write invariant), on the host when that node has a host copy. The recorder keeps a
reference count per (medium, hash) of the nodes holding it and emits `BlockStored` when a
hash appears on a medium and `BlockRemoved` when it disappears, so the event stream replayed
into an empty index equals `held()` at every step (tests/test_kv_events_engine.py).

Transitions (the tree and its host layer report them through the `TreeObserver` hooks; a tree
without events reports to a `NoObserver`):
- a new leaf (insert) or a host-only node taking the caller's blocks (insert), a host-only
  node loaded back (SwapIn): Stored GPU;
- device eviction that writes back: Stored CPU (unless the node had a host copy), Removed GPU;
  eviction without a host tier, or with no room on the host: Removed GPU (and CPU, for the
  host copies of the removed subtree); trimming a long leaf's tail (`trimmed`): Removed GPU for
  the full blocks it loses;
- host eviction (a host copy dropped, or a host-only leaf leaving the tree): Removed CPU;
- `discard_copies` after a failed step: Removed for each copy it forgets;
- `reset`: Removed per dropped node, or one `AllBlocksCleared` when nothing stays cached;
- a split moves ownership between the two halves and emits nothing.
A node's hashes are computed once, when it enters the tree (kept in `node.block_hashes`; a
split divides them, a trim cuts them). A sequence's first block hashes in its namespace's
`event_salt` (`radixrt.cache.namespace`).
Holders outside the tree count on their own medium through `hold` / `release`: the storage
tier's pages (`radixrt.cache.storage_events`).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from radixrt.cache.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_hash,
)
from radixrt.cache.namespace import CacheNamespace
from radixrt.cache.radix_node import RadixNode


class RadixEventRecorder:
    """Turns the radix tree's node transitions into vLLM KV events (see the module
    docstring); a `radixrt.cache.radix_node.TreeObserver`. Plain Python; the owner takes the
    events once per step (`take`)."""

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        # medium -> hash -> holders (tree nodes; on a storage medium, stored pages)
        self._held: defaultdict[str, Counter[bytes]] = defaultdict(Counter)
        self._events: list[KVCacheEvent] = []
        self._reset_mark: int | None = None

    # ---- hooks (TreeObserver) ----
    def added(self, node: RadixNode, namespace: CacheNamespace) -> None:
        """`node` entered the tree on the device (a new leaf of `namespace`): hash its full
        blocks."""
        self._compute(node, namespace)
        self.stored(node, MEDIUM_GPU)

    def stored(self, node: RadixNode, medium: str) -> None:
        """`node`'s KV is now on `medium` (it was not)."""
        hashes = node.block_hashes
        first = node.start // self.block_size
        for lo, hi in self._count(hashes, medium):
            self._emit_stored(node, first, hashes, lo, hi, medium)

    def removed(self, node: RadixNode, medium: str) -> None:
        """`node`'s KV left `medium`."""
        self._remove(node.block_hashes, medium)

    def trimmed(self, node: RadixNode, keep: int) -> None:
        """`node`, a device leaf, lost its full blocks from the keep-th on."""
        hashes = node.block_hashes
        self._remove(hashes[keep:], MEDIUM_GPU)
        del hashes[keep:]

    def split(self, upper: RadixNode, lower: RadixNode) -> None:
        """The full blocks ending before the cut go to `upper`."""
        num_up = lower.start // self.block_size - upper.start // self.block_size
        upper.block_hashes = lower.block_hashes[:num_up]
        lower.block_hashes = lower.block_hashes[num_up:]

    # ---- holders outside the tree (the storage tier) ----
    def hold(
        self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], medium: str
    ) -> None:
        """Blocks `hashes` (consecutive, after the block hashed `parent`, None: from the first;
        `token_ids`: block_size per hash) are held once more on `medium`."""
        bs = self.block_size
        for lo, hi in self._count(hashes, medium):
            before = parent if lo == 0 else hashes[lo - 1]
            self._append_stored(hashes[lo:hi], before, token_ids[lo * bs : hi * bs], medium)

    def release(self, hashes: list[bytes], medium: str) -> None:
        """One holder of each of `hashes` on `medium` holds it no more."""
        self._remove(hashes, medium)

    def _count(self, hashes: list[bytes] | None, medium: str) -> list[tuple[int, int]]:
        """Count `hashes` held once more on `medium`; the runs [lo, hi) of those new on it."""
        if not hashes:
            return []
        held = self._held[medium]
        runs = []
        run_start = None  # index in hashes of the current run of new hashes
        for i, h in enumerate(hashes):
            held[h] += 1
            if held[h] == 1 and run_start is None:
                run_start = i
            elif held[h] > 1 and run_start is not None:
                runs.append((run_start, i))
                run_start = None
        if run_start is not None:
            runs.append((run_start, len(hashes)))
        return runs

    def _remove(self, hashes: list[bytes], medium: str) -> None:
        """The nodes holding `hashes` on `medium` hold them no more."""
        if not hashes:
            return
        held = self._held[medium]
        gone = []
        for h in hashes:
            if held[h] == 1:
                del held[h]
                gone.append(external_hash(h))
            else:
                held[h] -= 1
        if gone:
            self._events.append(BlockRemoved(gone, medium))

    def reset_started(self) -> None:
        self._reset_mark = len(self._events)

    def reset_done(self) -> None:
        """A reset left nothing cached on any medium (storage included): one AllBlocksCleared
        replaces its removals."""
        assert self._reset_mark is not None
        if not any(self._held.values()):
            del self._events[self._reset_mark :]
            self._events.append(AllBlocksCleared())
        self._reset_mark = None

    # ---- the owner ----
    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, in order (clears them)."""
        events, self._events = self._events, []
        return events

    def held(self, medium: str) -> set[int]:
        """External hashes of the full blocks held on `medium` now."""
        return {external_hash(h) for h in self._held.get(medium, ())}

    def held_counts(self, medium: str) -> Counter[bytes]:
        """Holders of each hash on `medium` now (a copy)."""
        return Counter(self._held.get(medium, ()))

    def check_integrity(self, roots: list[RadixNode]) -> None:
        """Every node's hashes cover its full blocks, and the counts per medium are the
        nodes holding each hash on it (the tree's state, not the events sent); `roots`: the
        tree's roots (one per namespace)."""
        bs = self.block_size
        want = {MEDIUM_GPU: Counter(), MEDIUM_CPU: Counter()}
        stack = [child for root in roots for child in root.children.values()]
        while stack:
            node = stack.pop()
            hashes = node.block_hashes
            assert hashes is not None and len(hashes) == node.end // bs - node.start // bs
            if node.blocks:
                want[MEDIUM_GPU].update(hashes)
            if node.host_blocks:
                want[MEDIUM_CPU].update(hashes)
            stack += node.children.values()
        have = {medium: self._held.get(medium, Counter()) for medium in want}
        assert want == have, "KV event counts out of sync with the tree"

    # ---- internals ----
    def _emit_stored(
        self, node: RadixNode, first: int, hashes: list[bytes], lo: int, hi: int, medium: str
    ) -> None:
        """BlockStored for hashes[lo:hi] (block indices first + lo ..)."""
        bs = self.block_size
        parent = self.hash_before(node, first + lo) if lo == 0 else hashes[lo - 1]
        tokens = self._tokens(node, (first + lo) * bs, (first + hi) * bs)
        self._append_stored(hashes[lo:hi], parent, tokens, medium)

    def _append_stored(
        self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], medium: str
    ) -> None:
        self._events.append(
            BlockStored(
                [external_hash(h) for h in hashes],
                None if parent is None else external_hash(parent),
                token_ids,
                self.block_size,
                None,
                medium,
            )
        )

    def _compute(self, node: RadixNode, namespace: CacheNamespace) -> None:
        """Fill `node.block_hashes` (its parent's are filled: it entered the tree first)."""
        bs = self.block_size
        first, end = node.start // bs, node.end // bs
        if end <= first:
            node.block_hashes = []
            return
        parent = self.hash_before(node, first)
        salt = namespace.event_salt if parent is None else None
        tokens = self._tokens(node, first * bs, end * bs)
        node.block_hashes = self.hasher.chain(parent, tokens, salt)

    def hash_before(self, node: RadixNode, index: int) -> bytes | None:
        """Hash of block index-1 of node's path (None for index 0): an ancestor owns it."""
        if index == 0:
            return None
        last = index * self.block_size - 1  # its last token
        anc = node.parent
        while anc.start > last:
            anc = anc.parent
        return anc.block_hashes[index - 1 - anc.start // self.block_size]

    @staticmethod
    def _tokens(node: RadixNode, lo: int, hi: int) -> list[int]:
        """Tokens of positions lo..hi-1 of node's path (hi <= node.end)."""
        parts = [node.key[max(lo - node.start, 0) : hi - node.start]]
        anc = node
        while anc.start > lo:
            anc = anc.parent
            parts.append(anc.key[max(lo - anc.start, 0) :])
        parts.reverse()
        return [t for part in parts for t in part]
