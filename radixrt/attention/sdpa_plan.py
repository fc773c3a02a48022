"""Step plan of the SDPA backend: which queries and KV blocks each batched attention call reads.

`plan_attention` runs once per step (from the ForwardBatch's CPU copies) and every layer reuses
its index tensors. Rows become *pieces*: a decode row is one piece of one query; an extend row is
cut into query chunks of at most `q_chunk` tokens, each reading its row's KV only up to its last
query (causal: the keys after it are never gathered). Pieces are packed into *groups*, one
`scaled_dot_product_attention` call per group and layer, each piece padded to the group's
longest query chunk and KV length:

- decode pieces and extend pieces never share a group (they are attended differently);
- decode pieces are sorted by KV length, extend pieces by query x key area, and packed greedily
  while the padded area stays within `max_waste` x the real one (or under `SMALL_AREA`) and the
  group's gathered KV and score sizes stay within the budgets. A single piece always fits.
  Extend attention is compute-bound on CPU, so padding costs more than calls: on 64 extend rows
  of 1-64 new tokens over 0-1024 cached, max_waste 1.2 (43 groups) ran 2.1x faster than 2.0
  (14 groups) and 2.6x faster than one padded group (benchmarks/bench_cpu_attention.py
  --max-waste).

Padding never reads outside a row: padded queries repeat the piece's last query (their results go
to a trash row, index T), padded key blocks repeat the row's last block (masked out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from radixrt.attention.forward_batch import ForwardBatch

SMALL_AREA = 4096  # padded area below which a group takes any piece (call overhead dominates)


class PlanLimits(NamedTuple):
    q_chunk: int  # most queries of one extend row in one piece
    max_waste: float  # padded query x key area / real area allowed in one group (>= 1)
    max_group_kv_elements: int  # gathered K (or V) elements of a group: n * kv_len * hkv * d
    max_group_score_elements: int  # scores of a group: n * num_heads * q_len * kv_len


DEFAULT_LIMITS = PlanLimits(
    q_chunk=256, max_waste=1.2, max_group_kv_elements=1 << 24, max_group_score_elements=1 << 25
)


class AttentionGroup(NamedTuple):
    """One batched attention call: `num_pieces` pieces padded to `q_len` x `kv_len`."""

    num_pieces: int  # n
    q_len: int  # padded queries per piece (1 for a decode group)
    kv_len: int  # padded keys per piece: num_kv_blocks * block_size
    q_index: torch.Tensor  # [n * q_len] int64: token (in the step's T) of each padded query
    out_index: torch.Tensor  # [n * q_len] int64: where each result goes; T (trash) for pads
    blocks: torch.Tensor  # [n * kv_len / block_size] int64: pool block of each key block
    mask: torch.Tensor  # [n, 1, 1 | q_len, kv_len] bool: True where the query sees the key
    # (empty for a causal group)
    token_range: tuple[int, int] | None  # (first, stop) when the padded queries are exactly
    # the tokens first..stop-1 in order, none padded (decode rows in row order; whole extend
    # rows of one length, in order): q read and results written in place, no index ops
    causal: bool  # every piece starts at key 0 with its first query (a fresh prompt's whole
    # row): SDPA's top-left causal mask is exact for its real queries (`mask` unused)


class _Pieces(NamedTuple):
    row: np.ndarray  # [P] int64: row of each piece
    q0: np.ndarray  # [P] int64: first query of the piece, within its row's new tokens
    q_len: np.ndarray  # [P] int64: queries of the piece (>= 1)
    kv_blocks: np.ndarray  # [P] int64: blocks the piece reads (its KV ends at its last query)


def _cut_rows(
    rows: np.ndarray, q_len: np.ndarray, prefix: np.ndarray, bs: int, chunk: np.ndarray
) -> _Pieces:
    """Cut each row of `rows` into query chunks of `chunk[row]` queries (vectorised)."""
    num = -(-q_len[rows] // chunk[rows])
    row = np.repeat(rows, num)
    first = np.repeat(np.cumsum(num) - num, num)
    q0 = (np.arange(row.shape[0]) - first) * chunk[row]
    n = np.minimum(chunk[row], q_len[row] - q0)
    kv_len = prefix[row] + q0 + n
    return _Pieces(row, q0, n, -(-kv_len // bs))


def _pack(
    order: np.ndarray,
    q_len: np.ndarray,
    kv_len: np.ndarray,
    max_waste: float,
    fits: Callable[[int, int, int], bool],
) -> list[np.ndarray]:
    """Greedy packing of pieces taken in `order`; `fits(n, q, k)` checks a group's budgets."""
    groups: list[np.ndarray] = []
    start, max_q, max_k, real = 0, 0, 0, 0
    for i, p in enumerate(order.tolist()):
        q, k = int(q_len[p]), int(kv_len[p])
        nq, nk, nreal, n = max(max_q, q), max(max_k, k), real + q * k, i - start + 1
        padded = n * nq * nk
        if n > 1 and not (
            (padded <= max_waste * nreal or padded <= SMALL_AREA) and fits(n, nq, nk)
        ):
            groups.append(order[start:i])
            start, nq, nk, nreal = i, q, k, q * k
        max_q, max_k, real = nq, nk, nreal
    if start < len(order):
        groups.append(order[start:])
    return groups


def plan_attention(
    batch: ForwardBatch,
    num_heads: int,
    kv_elements_per_token: int,
    limits: PlanLimits,
    skip_blocks: np.ndarray | None = None,
    leave_out: np.ndarray | None = None,
) -> list[AttentionGroup]:
    """Groups covering every new token of `batch` exactly once (see the module docstring).
    `kv_elements_per_token` is num_kv_heads * head_dim. Index tensors are on batch's device.
    `skip_blocks` [R] int64: leading blocks of each row that the groups leave out (attended
    apart as a shared prefix, `sdpa_prefix`; at most the full blocks before the row's new
    tokens); a row's groups then read its blocks from there on, its mask counts keys from
    there. `leave_out` [R] bool: rows the groups leave out (attended elsewhere)."""
    bs, nd = batch.block_size, batch.num_decode
    skip = np.zeros(batch.num_rows, np.int64) if skip_blocks is None else skip_blocks
    qo = batch.qo_indptr_cpu.numpy().astype(np.int64)
    seq = batch.seq_lens_cpu.numpy().astype(np.int64)
    kvp = batch.kv_indptr_cpu.numpy().astype(np.int64)
    q_len = qo[1:] - qo[:-1]
    prefix = seq - q_len
    # Extend rows: chunk so that one piece alone stays within the score budget.
    per_query = num_heads * (seq + bs)
    chunk = np.clip(limits.max_group_score_elements // per_query, 1, limits.q_chunk)
    chunk[:nd] = 1
    all_rows = np.arange(batch.num_rows, dtype=np.int64)
    groups: list[AttentionGroup] = []
    for rows, is_decode in ((all_rows[:nd], True), (all_rows[nd:], False)):
        if leave_out is not None:
            rows = rows[~leave_out[rows]]
        if rows.shape[0] == 0:
            continue
        pieces = _cut_rows(rows, q_len, prefix, bs, chunk)
        pieces = pieces._replace(kv_blocks=pieces.kv_blocks - skip[pieces.row])
        kv_len = pieces.kv_blocks * bs
        area = pieces.q_len * kv_len
        order = np.argsort(-(kv_len if is_decode else area), kind="stable")

        def fits(n: int, q: int, k: int) -> bool:
            return (
                n * k * kv_elements_per_token <= limits.max_group_kv_elements
                and n * q * k * num_heads <= limits.max_group_score_elements
            )

        for ids in _pack(order, pieces.q_len, kv_len, limits.max_waste, fits):
            # order within a group does not matter: rows in order, so that consecutive
            ids = np.sort(ids)  # rows read q and write results in place (token_range)
            groups.append(_build_group(batch, pieces, ids, qo, prefix - skip * bs, kvp[:-1] + skip))
    return groups


def _build_group(
    batch: ForwardBatch,
    pieces: _Pieces,
    ids: np.ndarray,
    qo: np.ndarray,
    prefix: np.ndarray,
    kv_start: np.ndarray,
) -> AttentionGroup:
    """`prefix`: keys before each row's new tokens that its pieces read; `kv_start`: index
    into kv_indices of each row's first block read (both [R], after any skipped blocks)."""
    bs, dev, num_tokens = batch.block_size, batch.kv_indices.device, batch.num_tokens
    row, q0, n_q, n_blk = (a[ids] for a in pieces)
    q_pad, blk_pad = int(n_q.max()), int(n_blk.max())
    j = np.arange(q_pad)
    q_in_row = q0[:, None] + np.minimum(j[None, :], n_q[:, None] - 1)  # [n, q_pad]
    q_index = qo[row][:, None] + q_in_row
    out_index = np.where(j[None, :] < n_q[:, None], q_index, num_tokens)
    blk = kv_start[row][:, None] + np.minimum(np.arange(blk_pad)[None, :], n_blk[:, None] - 1)
    to_dev = lambda a: torch.from_numpy(a.reshape(-1)).to(dev)  # noqa: E731
    first, n = int(q_index[0, 0]), len(ids)
    flat = q_index.reshape(-1)
    in_order = bool((n_q == q_pad).all() and (flat == np.arange(first, first + n * q_pad)).all())
    # A piece's real query t (< its q_len) sees keys 0..t exactly when it starts at key 0;
    # padded keys (>= its q_len) are then seen only by padded queries.
    causal = q_pad > 1 and bool((prefix[row] + q0 == 0).all())
    if causal:
        mask = torch.empty((0, 1, 1, 0), dtype=torch.bool, device=dev)
    else:  # query at new-token offset t of a row with prefix p sees keys 0..p + t
        limit = torch.from_numpy(prefix[row][:, None] + q_in_row + 1).to(dev)  # [n, q_pad]
        key = torch.arange(blk_pad * bs, device=dev)
        mask = (key[None, None, :] < limit[:, :, None]).unsqueeze(1)  # [n, 1, q_pad, kv_len]
    return AttentionGroup(
        num_pieces=len(ids),
        q_len=q_pad,
        kv_len=blk_pad * bs,
        q_index=to_dev(q_index),
        out_index=to_dev(out_index),
        blocks=batch.kv_indices[to_dev(blk)].to(torch.int64),
        mask=mask,
        token_range=(first, first + n * q_pad) if in_order else None,
        causal=causal,
    )
