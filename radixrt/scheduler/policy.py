"""Waiting-queue policies: which waiting request is admitted first.

- fcfs: arrival order.
- random: a shuffle of the queue, seeded by its arrival numbers (an ablation: the order a
  cache-unaware scheduler that ignores arrival could pick; reproducible run to run).
- lpm: longest cached prefix first (more reuse, less compute), plus aging.
- dfs-weight: walk the radix tree depth-first, children before the node itself and heavier
  subtrees (more waiting requests below) first, so requests sharing a prefix run back to
  back and a request with a cached prefix goes before one without (SGLang's
  get_dfs_priority order); plus aging.

Aging: a request's priority is its matched tokens + aging_tokens_per_step * waited steps.
Bound (tested): a waiting request is never overtaken by one that arrived more than
max_prompt_len / aging_tokens_per_step steps after it, so lpm delays a request at most by
the requests arriving in that window, compared with FCFS.

Priority (RequestOptions.priority, lower first) comes before every policy: the waiting queue
is ordered by effective priority, then by the policy within each level (a stable sort, so
fcfs keeps arrival order, a preempted request first). A request's effective priority is its
priority minus one per `priority_aging_steps` steps it waited (0: no aging across levels).
Bound: a waiting request of priority p is overtaken by requests of priority q < p only until
it waited (p - q) * priority_aging_steps steps; after that it competes with them as above.
That never closes a wide gap, so there is a bound in time too: a request queued for
`priority_max_wait_s` or longer (`overdue`) goes ahead of every priority level, the overdue
in queue order (FCFS: a preempted request first), so a request of the lowest priority waits
for the overdue ones queued before it, never for newer ones. (Under an overload that keeps
every request waiting that long, the order is FCFS.)

The policies never call the cache: the scheduler matches each waiting request once per
step and passes the results in (`matched`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from radixrt.cache.base import MatchResult
from radixrt.scheduler.request import Request

# Matching every waiting request costs O(prompt length) each; past this queue length
# the cache-aware policies fall back to FCFS (SGLang does the same).
MAX_QUEUE_FOR_MATCHING = 256
# A waiting request sharing at least this many not-yet-cached prefix tokens with a request
# being prefilled waits for that prefill to land in the cache (lpm / dfs-weight only).
IN_BATCH_PREFIX_THRESHOLD = 32


def share_prefix(a: Sequence[int], b: Sequence[int], n: int) -> bool:
    """Whether `a` and `b` both have at least `n` tokens and agree on the first `n`. Token
    n - 1 is compared first: requests behind one cached prefix mostly differ right after
    it, so the full comparison (at C speed) runs only for the likely matches."""
    if n <= 0:
        return True
    if len(a) < n or len(b) < n or a[n - 1] != b[n - 1]:
        return False
    return a[:n] == b[:n]


def effective_priority(req: Request, priority_aging_steps: int) -> int:
    """`req.priority` aged: one level more urgent (lower) per `priority_aging_steps` waited
    steps (0: not aged)."""
    if priority_aging_steps <= 0:
        return req.priority
    return req.priority - req.waited_steps // priority_aging_steps


def order_waiting(
    waiting: Sequence[Request],
    policy: str,
    matched: Callable[[Request], MatchResult],
    aging_per_step: float,
    priority_aging_steps: int = 0,
    overdue: Callable[[Request], bool] | None = None,
) -> list[Request]:
    """Return `waiting` (given in FCFS order) in admission order: the `overdue` ones first in
    that order, then by effective priority, then by `policy` within a level. `matched(req)`
    is the request's prefix match of this step."""
    if overdue is not None:
        late = [r for r in waiting if overdue(r)]
        if late:
            rest = [r for r in waiting if not overdue(r)]
            return late + order_waiting(rest, policy, matched, aging_per_step, priority_aging_steps)
    if len(waiting) > 1 and any(r.priority != waiting[0].priority for r in waiting):
        levels: dict[int, list[Request]] = {}
        for req in waiting:
            levels.setdefault(effective_priority(req, priority_aging_steps), []).append(req)
        return [
            req
            for level in sorted(levels)
            for req in _order_level(levels[level], policy, matched, aging_per_step)
        ]
    return _order_level(waiting, policy, matched, aging_per_step)


def _order_level(
    waiting: Sequence[Request],
    policy: str,
    matched: Callable[[Request], MatchResult],
    aging_per_step: float,
) -> list[Request]:
    """Requests of one effective priority in `policy` order."""
    if policy == "random":
        order = list(waiting)
        random.Random(hash(tuple(r.arrival for r in order))).shuffle(order)
        return order
    if policy == "fcfs" or len(waiting) <= 1 or len(waiting) > MAX_QUEUE_FOR_MATCHING:
        return list(waiting)
    matches = {req: matched(req) for req in waiting}
    age = {req: aging_per_step * req.waited_steps for req in waiting}
    if policy == "lpm" or not all(hasattr(m.handle, "children") for m in matches.values()):
        return sorted(waiting, key=lambda r: (-(matches[r].num_cached_tokens + age[r]), r.arrival))
    return _dfs_weight(waiting, {r: m.handle for r, m in matches.items()}, age)


def _dfs_weight(waiting: Sequence[Request], handles: dict, age: dict) -> list[Request]:
    """DFS of the tree in which a node's own requests (those whose match ends there) compete
    with its children: a child weighs the waiting requests below it plus their ages, an own
    request 1 plus its age; heavier first, and on a tie the child (a longer cached prefix)
    first. At equal ages this is SGLang's children-first order; a request aged past a
    branch's weight goes ahead of that branch."""
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
    # one root per cache namespace (radixrt.cache.radix): heavier subtrees first
    roots = sorted((n for n in nodes.values() if n.parent is None), key=lambda n: weight[id(n)])
    order: list[Request] = []
    stack: list[object] = list(roots)  # tree nodes, or requests ready to be emitted
    while stack:
        item = stack.pop()
        if isinstance(item, Request):
            order.append(item)
            continue
        # (weight, child before request, earlier arrival first) ascending = popped last
        entries = [(weight[id(c)], 1, 0, c) for c in item.children.values() if id(c) in weight]
        entries += [(1 + age[r], 0, -r.arrival, r) for r in by_node.get(id(item), [])]
        entries.sort(key=lambda e: e[:3])
        stack.extend(e[3] for e in entries)
    return order
