"""Waiting-queue policies: which waiting request is admitted first.

- fcfs: arrival order.
- lpm: longest cached prefix first (more reuse, less compute), plus aging.
- dfs-weight: walk the radix tree depth-first, heavier subtrees (more waiting requests
  below) first, so requests sharing a prefix run back to back; plus aging.

Aging: a request's priority is its matched tokens + aging_tokens_per_step * waited steps.
Bound (tested): a waiting request is never overtaken by one that arrived more than
max_prompt_len / aging_tokens_per_step steps after it, so lpm delays a request at most by
the requests arriving in that window, compared with FCFS.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixrt.cache.base import PrefixCache
from radixrt.scheduler.request import Request

# Matching every waiting request costs O(prompt length) each; past this queue length
# the cache-aware policies fall back to FCFS (SGLang does the same).
MAX_QUEUE_FOR_MATCHING = 256
# A waiting request sharing at least this many not-yet-cached prefix tokens with a request
# being prefilled waits for that prefill to land in the cache (lpm / dfs-weight only).
IN_BATCH_PREFIX_THRESHOLD = 32


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists (compares 64-token slices at C speed)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    i = min(i, n)
    end = min(i + 64, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i


def order_waiting(
    waiting: Sequence[Request], policy: str, cache: PrefixCache, aging_per_step: float
) -> list[Request]:
    """Return `waiting` in admission order (the input is in FCFS order)."""
    if policy == "fcfs" or len(waiting) <= 1 or len(waiting) > MAX_QUEUE_FOR_MATCHING:
        return list(waiting)
    matched = {}
    handles = {}
    for req in waiting:
        m = cache.match(req.token_ids[:-1])
        matched[req] = m.num_cached_tokens
        handles[req] = m.handle
    age = {req: aging_per_step * req.waited_steps for req in waiting}
    if policy == "lpm" or not all(hasattr(h, "children") for h in handles.values()):
        return sorted(waiting, key=lambda r: (-(matched[r] + age[r]), r.arrival))
    return _dfs_weight(waiting, handles, age)


def _dfs_weight(waiting: Sequence[Request], handles: dict, age: dict) -> list[Request]:
    """Order by a DFS of the tree, visiting children with more waiting requests first.

    Requests waiting past the aging threshold (age larger than any match) go first."""
    by_node: dict[int, list[Request]] = {}
    weight: dict[int, float] = {}
    nodes = {}
    for req in waiting:
        node = handles[req]
        by_node.setdefault(id(node), []).append(req)
        while node is not None:
            nodes[id(node)] = node
            weight[id(node)] = weight.get(id(node), 0) + 1 + age[req]
            node = node.parent
    root = next(n for n in nodes.values() if n.parent is None)
    order: list[Request] = []
    stack = [root]
    while stack:
        node = stack.pop()
        order.extend(sorted(by_node.get(id(node), []), key=lambda r: r.arrival))
        kids = [c for c in node.children.values() if id(c) in weight]
        kids.sort(key=lambda c: weight[id(c)])  # heaviest popped first
        stack.extend(kids)
    return order
