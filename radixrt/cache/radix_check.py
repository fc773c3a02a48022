"""The radix tree's self-check as a plain function over the pieces it reads: `check_tree`
(tree shape, lock counts, device reference counters, the device eviction candidate list). The
public entry point is `RadixCache.check_integrity`; a tier layer adds its own checks there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from sortedcontainers import SortedKeyList

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
    check_node: Callable[[RadixNode, int], None],
) -> None:
    """Assert tree shape, lock counts, device reference counters and the device candidate
    list. `roots`: the default namespace's root first, then the others; `refs` /
    `locked_refs`: device block -> (locked) nodes recording it, as the cache counts them;
    `total_tokens`: the cache's token count; `evictable`: its device eviction candidates;
    `check_node(node, num_blocks)`: asserts where a node's KV lives (its layer's rule)."""
    bs = block_size
    for top in roots:
        assert not top.key and top.parent is None and not top.blocks and not top.lock_ref
        assert top is roots[0] or top.children, "an empty namespace root"
    tree_refs: Counter[int] = Counter()
    locked: Counter[int] = Counter()
    leaves: set[int] = set()
    total = 0
    stack = list(roots)
    while stack:
        node = stack.pop()
        child_locks = 0
        for first, child in node.children.items():
            assert child.key and child.key[0] == first, "child keyed by its first token"
            assert child.parent is node and child.start == node.end
            check_node(child, (child.end - 1) // bs - child.start // bs + 1)
            assert len(set(child.blocks)) == len(child.blocks), "block twice in a node"
            assert child.lock_ref >= 0
            if node.key:
                assert node.lock_ref >= child.lock_ref
            child_locks += child.lock_ref
            tree_refs.update(child.blocks)
            if child.lock_ref:
                locked.update(child.blocks)
            if is_device_leaf(child):
                leaves.add(child.id)
            total += len(child.key)
            stack.append(child)
        if node.key:
            assert node.lock_ref >= child_locks, "lock_ref below the children's sum"
    assert tree_refs == refs, "reference counter out of sync"
    assert locked == locked_refs, "locked reference counter out of sync"
    assert total == total_tokens
    check_candidates(evictable, leaves, "in_lru")
    for b, r in tree_refs.items():
        assert allocator.ref_counts[b] >= r, f"block {b}: tree holds more refs"


def check_candidates(lru: SortedKeyList, members: set[int], flag: str) -> None:
    """`lru` lists exactly the nodes whose ids are `members`, once each, in key order, each
    with its `flag` attribute set."""
    listed = [node.id for node in lru]
    assert len(listed) == len(set(listed)) and set(listed) == members, "candidate list"
    assert all(getattr(node, flag) for node in lru)
    keys = [lru.key(node) for node in lru]
    assert keys == sorted(keys)


def walk(roots: list[RadixNode]) -> list[RadixNode]:
    """Every non-root node under `roots`."""
    nodes: list[RadixNode] = []
    stack = [c for top in roots for c in top.children.values()]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack += node.children.values()
    return nodes
