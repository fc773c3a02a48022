"""The radix cache's self-checks and printing: `check_integrity` (tree shape, tier
residency, lock counts, reference counters of both tiers, the eviction candidate lists, the
KV event recorder's counts) and `format_tree`.

`RadixChecks` is a mixin of `radixrt.cache.radix.RadixCache` (it reads the tree's root,
counters and candidate lists).
"""

from __future__ import annotations

from collections import Counter


class RadixChecks:
    def check_integrity(self) -> None:
        """Assert tree shape, tier residency, lock counts, reference counters (both tiers)
        and the candidate lists."""
        bs = self.block_size
        roots = self.roots
        for top in roots:
            assert not top.key and top.parent is None and not top.blocks and not top.lock_ref
            assert top is self.root or top.children, "an empty salted root"
        refs: Counter[int] = Counter()
        locked: Counter[int] = Counter()
        host_refs: Counter[int] = Counter()
        leaves: set[int] = set()
        host_candidates: set[int] = set()
        total = 0
        stack = list(roots)
        while stack:
            node = stack.pop()
            child_locks = 0
            for first, child in node.children.items():
                assert child.key and child.key[0] == first, "child keyed by its first token"
                assert child.parent is node and child.start == node.end
                num = (child.end - 1) // bs - child.start // bs + 1
                assert child.blocks or child.host_blocks, "a node with KV on no tier"
                assert len(child.blocks) in (0, num) and len(child.host_blocks) in (0, num)
                assert len(set(child.blocks)) == len(child.blocks), "block twice in a node"
                assert not child.blocks or not node.key or node.blocks, (
                    "a device node under a host-only node"
                )
                assert self.host is not None or not child.host_blocks
                assert child.lock_ref >= 0
                if node.key:
                    assert node.lock_ref >= child.lock_ref
                child_locks += child.lock_ref
                refs.update(child.blocks)
                host_refs.update(child.host_blocks)
                if child.lock_ref:
                    locked.update(child.blocks)
                if self._is_device_leaf(child):
                    leaves.add(child.id)
                if self._is_host_candidate(child):
                    host_candidates.add(child.id)
                total += len(child.key)
                stack.append(child)
            if node.key:
                assert node.lock_ref >= child_locks, "lock_ref below the children's sum"
        assert refs == self._refs, "reference counter out of sync"
        assert locked == self._locked_refs, "locked reference counter out of sync"
        assert host_refs == self._host_refs, "host reference counter out of sync"
        assert total == self._total_tokens
        for lru, members, flag in (
            (self._evictable, leaves, "in_lru"),
            (self._host_evictable, host_candidates, "in_host_lru"),
        ):
            listed = [node.id for node in lru]
            assert len(listed) == len(set(listed)) and set(listed) == members, "candidate list"
            assert all(getattr(node, flag) for node in lru)
            keys = [lru.key(node) for node in lru]
            assert keys == sorted(keys)
        for b, r in refs.items():
            assert self.allocator.ref_counts[b] >= r, f"block {b}: tree holds more refs"
        if self.host is not None:
            # Host blocks are held by tree nodes only: the counts match exactly, and
            # free + cached == total (a queued SwapIn's source stays recorded by its node
            # or is rewritten only by a later op: the runner runs ops in order).
            alloc = self.host.allocator
            alloc.check_integrity(host_refs)
            assert alloc.num_free + len(host_refs) == alloc.num_blocks, "host blocks leaked"
        if self.events is not None:
            self.events.check_integrity(self.roots)

    def format_tree(self) -> str:
        """One line per node: tokens, position range, blocks, lock_ref, last_access."""
        lines: list[str] = []
        stack = [(top, 0) for top in reversed(self.roots)]
        while stack:
            node, depth = stack.pop()
            if not node.key:
                salt = "" if node is self.root else f" salt={self.salt_of(node)!r}"
                lines.append(
                    f"root{salt} tokens={self._total_tokens} cached_blocks={self.cached_blocks}"
                )
            else:
                host = f" host={node.host_blocks}" if node.host_blocks else ""
                lines.append(
                    f"{'  ' * depth}{node.key} [{node.start},{node.end}) blocks={node.blocks}"
                    f"{host} lock={node.lock_ref} t={node.last_access}"
                )
            for first in sorted(node.children, reverse=True):
                stack.append((node.children[first], depth + 1))
        return "\n".join(lines)

    def pretty_print(self) -> None:
        print(self.format_tree())
