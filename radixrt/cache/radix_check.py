"""The radix cache's self-checks and printing, as plain functions over the pieces they read:
`check_tree` (tree shape, tier residency, lock counts, reference counters of both tiers, the
eviction candidate lists, the KV event recorder's counts) and `format_tree`. The public entry
points are `RadixCache.check_integrity` and `RadixCache.format_tree`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from sortedcontainers import SortedKeyList

from radixrt.cache.radix_events import RadixEventRecorder
from radixrt.cache.radix_host import RadixHostTier, is_host_candidate
from radixrt.cache.radix_node import RadixNode, is_device_leaf
from radixrt.kv.allocator import BlockAllocator


def check_tree(
    roots: list[RadixNode],
    block_size: int,
    allocator: BlockAllocator,
    refs: Counter[int],
    locked_refs: Counter[int],
    total_tokens: int,
    evictable: SortedKeyList,
    host_tier: RadixHostTier | None,
    events: RadixEventRecorder | None,
) -> None:
    """Assert tree shape, tier residency, lock counts, reference counters (both tiers) and the
    candidate lists. `roots`: the unsalted root first, then the salted ones; `refs` /
    `locked_refs`: device block -> (locked) nodes recording it, as the cache counts them;
    `total_tokens`: the cache's token count; `evictable`: its device eviction candidates."""
    bs = block_size
    for top in roots:
        assert not top.key and top.parent is None and not top.blocks and not top.lock_ref
        assert top is roots[0] or top.children, "an empty salted root"
    tree_refs: Counter[int] = Counter()
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
            assert host_tier is not None or not child.host_blocks
            assert child.lock_ref >= 0
            if node.key:
                assert node.lock_ref >= child.lock_ref
            child_locks += child.lock_ref
            tree_refs.update(child.blocks)
            host_refs.update(child.host_blocks)
            if child.lock_ref:
                locked.update(child.blocks)
            if is_device_leaf(child):
                leaves.add(child.id)
            if is_host_candidate(child):
                host_candidates.add(child.id)
            total += len(child.key)
            stack.append(child)
        if node.key:
            assert node.lock_ref >= child_locks, "lock_ref below the children's sum"
    assert tree_refs == refs, "reference counter out of sync"
    assert locked == locked_refs, "locked reference counter out of sync"
    assert total == total_tokens
    lists = [(evictable, leaves, "in_lru")]
    if host_tier is None:
        assert not host_refs and not host_candidates
    else:
        assert host_refs == host_tier.refs, "host reference counter out of sync"
        lists.append((host_tier.evictable, host_candidates, "in_host_lru"))
    for lru, members, flag in lists:
        listed = [node.id for node in lru]
        assert len(listed) == len(set(listed)) and set(listed) == members, "candidate list"
        assert all(getattr(node, flag) for node in lru)
        keys = [lru.key(node) for node in lru]
        assert keys == sorted(keys)
    for b, r in tree_refs.items():
        assert allocator.ref_counts[b] >= r, f"block {b}: tree holds more refs"
    if host_tier is not None:
        # Host blocks are held by tree nodes only: the counts match exactly, and
        # free + cached == total (a queued SwapIn's source stays recorded by its node
        # or is rewritten only by a later op: the runner runs ops in order).
        alloc = host_tier.host.allocator
        alloc.check_integrity(host_refs)
        assert alloc.num_free + len(host_refs) == alloc.num_blocks, "host blocks leaked"
    if events is not None:
        events.check_integrity(roots)


def format_tree(
    roots: list[RadixNode],
    salt_of: Callable[[RadixNode], str | None],
    total_tokens: int,
    cached_blocks: int,
) -> str:
    """One line per node: tokens, position range, blocks, lock_ref, last_access (`roots`: the
    unsalted root first)."""
    lines: list[str] = []
    stack = [(top, 0) for top in reversed(roots)]
    while stack:
        node, depth = stack.pop()
        if not node.key:
            salt = "" if node is roots[0] else f" salt={salt_of(node)!r}"
            lines.append(f"root{salt} tokens={total_tokens} cached_blocks={cached_blocks}")
        else:
            host = f" host={node.host_blocks}" if node.host_blocks else ""
            lines.append(
                f"{'  ' * depth}{node.key} [{node.start},{node.end}) blocks={node.blocks}"
                f"{host} lock={node.lock_ref} t={node.last_access}"
            )
        for first in sorted(node.children, reverse=True):
            stack.append((node.children[first], depth + 1))
    return "\n".join(lines)
