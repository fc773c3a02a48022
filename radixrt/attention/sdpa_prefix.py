"""Shared-prefix (cascade) attention for the SDPA backend: plan side.

Rows that start with the same KV blocks (the radix cache shares a common prompt prefix by
block reference) attend that prefix together: one SDPA call whose queries are every new token
of those rows, all query heads of a KV head as one problem ([1, kv_heads, tokens x group, d]
against the prefix's keys, read and gathered once) instead of one gathered copy and one
attention problem per row. Each row's remaining blocks go through the ordinary groups
(`plan_attention(skip_blocks=...)`), and the two partial results are merged with their
log-sum-exps:
    out = (o1 * exp(l1 - m) + o2 * exp(l2 - m)) / (exp(l1 - m) + exp(l2 - m)),  m = max(l1, l2)
(`merge_partial`). Only full blocks before a row's new tokens are shared (decode rows: every
block but the last, which is the row's own, being written), so every new token of a row sees
every shared key: no mask. This is FlashInfer's cascade idea, planned from the block tables.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from radixrt.attention.forward_batch import ForwardBatch

MIN_ROWS = 2  # rows that must share a prefix for a prefix group
MIN_BLOCKS = 2  # shared blocks below which a prefix group is not worth a call
# (rows - 1) x shared keys below which a group costs more (one more SDPA call, the merge) than
# it saves (gathering and attending those keys once per row): on the tiny model (2 cores,
# bench_serving smoke workloads at concurrency 32) 0 made multi-turn / agent attention 20-40%
# slower, 1024-2048 kept them level and shared-prefix 40% faster.
MIN_SAVED_KEYS = 1024


class PrefixGroup(NamedTuple):
    """Rows sharing their leading blocks, and their new tokens (the queries)."""

    num_rows: int  # rows of the group (>= MIN_ROWS)
    tokens: torch.Tensor  # [Q] int64: the rows' new tokens (indices into the step's T), sorted
    blocks: torch.Tensor  # [p] int64: pool blocks of the shared prefix, in order


class PrefixPlan(NamedTuple):
    groups: list[PrefixGroup]
    skip_blocks: np.ndarray  # [R] int64: each row's leading blocks attended in its group


def plan_shared_prefixes(
    batch: ForwardBatch,
    min_rows: int = MIN_ROWS,
    min_blocks: int = MIN_BLOCKS,
    extend_rows: bool = True,
    min_saved_keys: int | None = None,
    leave_out: np.ndarray | None = None,
) -> PrefixPlan:
    """Prefix groups of the step's rows. Rows (their full blocks before their new tokens) are
        sorted as
    block sequences, so rows sharing a prefix are neighbours; a run of neighbours shares the
        smallest common prefix between them, and a run is split at its weakest link whenever the
        parts save more block reads ((rows - 1) x shared blocks) than the whole (e.g. two
        families of rows on different long prompts that share only a chat template's first
        block). Runs with fewer than `min_rows` rows or `min_blocks` blocks, or saving fewer than
    `min_saved_keys` (default MIN_SAVED_KEYS) key reads, are dropped. `extend_rows=False` leaves
    the extend rows out of every group, `leave_out` [R] bool the rows it marks."""
    dev, bs = batch.kv_indices.device, batch.block_size
    min_saved = MIN_SAVED_KEYS if min_saved_keys is None else min_saved_keys
    skip = np.zeros(batch.num_rows, dtype=np.int64)
    kvp = batch.kv_indptr_cpu.numpy().astype(np.int64)
    qo = batch.qo_indptr_cpu.numpy().astype(np.int64)
    cached = batch.seq_lens_cpu.numpy().astype(np.int64) - (qo[1:] - qo[:-1])
    full = cached // bs  # [R] full blocks before each row's new tokens
    if not extend_rows:
        full[batch.num_decode :] = 0
    if leave_out is not None:
        full[leave_out] = 0
    rows = np.flatnonzero(full >= min_blocks)
    if rows.shape[0] < min_rows or (rows.shape[0] - 1) * int(full.max()) * bs < min_saved:
        return PrefixPlan([], skip)
    indices = batch.kv_indices.cpu().numpy()
    firsts = indices[kvp[rows]]
    if np.unique(firsts).shape[0] == firsts.shape[0]:  # no two rows share a first block
        return PrefixPlan([], skip)
    depth = int(full[rows].max())
    col = np.arange(depth)[None, :]
    valid = col < full[rows][:, None]
    table = np.where(valid, indices[np.where(valid, kvp[rows][:, None] + col, 0)], -1)
    order = np.lexsort(table.T[::-1])
    rows, table = rows[order], table[order]
    same = (table[1:] == table[:-1]) & (table[1:] >= 0)
    lcp = np.cumprod(same, axis=1).sum(axis=1)  # [m - 1] shared blocks of neighbours
    groups: list[PrefixGroup] = []
    for lo, hi, shared in _runs(lcp.tolist(), min_blocks):
        if hi - lo + 1 < min_rows or (hi - lo) * shared * bs < min_saved:
            continue
        members = np.sort(rows[lo : hi + 1])
        skip[members] = shared
        tokens = np.concatenate([np.arange(qo[r], qo[r + 1]) for r in members])
        groups.append(
            PrefixGroup(
                num_rows=len(members),
                tokens=torch.from_numpy(tokens).to(dev),
                blocks=torch.from_numpy(table[lo, :shared].astype(np.int64)).to(dev),
            )
        )
    return PrefixPlan(groups, skip)


def _runs(lcp: list[int], min_blocks: int) -> list[tuple[int, int, int]]:
    """(first, last, shared blocks) runs of the sorted rows (see plan_shared_prefixes), given
    `lcp[i]`, the blocks rows i and i + 1 share. Splitting every range at its weakest link is
    the min-Cartesian tree of `lcp`: built with a stack and evaluated bottom-up, without
    recursion, in O(rows)."""
    n = len(lcp)
    if n == 0:
        return []
    left, right, stack = [-1] * n, [-1] * n, []
    for i in range(n):
        last = -1
        while stack and lcp[stack[-1]] > lcp[i]:
            last = stack.pop()
        left[i] = last
        if stack:
            right[stack[-1]] = i
        stack.append(i)
    root = stack[0]
    order, todo = [], [root]  # parents before children
    while todo:
        i = todo.pop()
        order.append(i)
        todo.extend(c for c in (left[i], right[i]) if c >= 0)
    lo, hi, best, whole_ok = [0] * n, [0] * n, [0] * n, [False] * n
    for i in reversed(order):  # link i joins rows i and i + 1; its subtree spans lo..hi
        a, b = left[i], right[i]
        lo[i] = lo[a] if a >= 0 else i
        hi[i] = hi[b] if b >= 0 else i + 1
        parts = (best[a] if a >= 0 else 0) + (best[b] if b >= 0 else 0)
        whole = (hi[i] - lo[i]) * lcp[i]  # (rows - 1) x shared blocks: reads saved
        whole_ok[i] = lcp[i] >= min_blocks and whole >= parts
        best[i] = whole if whole_ok[i] else parts
    runs, todo = [], [root]
    while todo:
        i = todo.pop()
        if whole_ok[i]:
            runs.append((lo[i], hi[i], lcp[i]))
        else:
            todo.extend(c for c in (left[i], right[i]) if c >= 0)
    return runs


def merge_partial(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
) -> torch.Tensor:
    """Attention over two disjoint key sets -> over their union. o [Q, h, d], l [Q, h] the
    natural log-sum-exp of each part's scaled scores (float32). Returns [Q, h, d] in o1's
    dtype."""
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    total = w1 + w2
    out = o1.float() * (w1 / total).unsqueeze(-1) + o2.float() * (w2 / total).unsqueeze(-1)
    return out.to(o1.dtype)
