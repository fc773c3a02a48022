"""Test-side readers of a radix tree's structure: a node's block for a position, the
namespace a node lies in, and a printout of the tree (for assertion messages)."""

from __future__ import annotations

from radixrt.cache.namespace import CacheNamespace
from radixrt.cache.radix import RadixCache, RadixNode


def block_at(node: RadixNode, pos: int, block_size: int) -> int:
    """Block `node` records for absolute position `pos` (start <= pos < end)."""
    assert node.start <= pos < node.end
    return node.blocks[pos // block_size - node.start // block_size]


def namespace_of(cache: RadixCache, handle: RadixNode) -> CacheNamespace:
    """The namespace of the subtree the live node `handle` lies in."""
    node = handle
    while node.key:
        node = node.parent
    return next(ns for ns, root in cache._roots.items() if root is node)


def format_tree(cache: RadixCache) -> str:
    """One line per node: tokens, position range, blocks (host copy), lock_ref, last_access;
    the default namespace's root first."""
    roots = cache.roots
    lines: list[str] = []
    stack = [(top, 0) for top in reversed(roots)]
    while stack:
        node, depth = stack.pop()
        if not node.key:
            ns = "" if node is roots[0] else f" {namespace_of(cache, node)!r}"
            lines.append(
                f"root{ns} tokens={cache.total_tokens} cached_blocks={cache.cached_blocks}"
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
