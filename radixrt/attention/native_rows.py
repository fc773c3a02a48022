"""Which rows of a CPU step the native kernels attend, and their inputs.

Two kernels read the paged KV in place. The decode kernel (`radixrt.kernels.paged_decode_cpu`)
attends single queries: a decode row is one query over its whole row. The extend kernel
(`radixrt.kernels.paged_extend_cpu`) attends an extend row's new tokens together, causally,
tiling queries so that each key is loaded once per tile (32 fresh rows of 128 tokens, tiny
Llama, a layer on one thread: 3.7-5.1 ms vs 9.3-12 ms for SDPA on gathered K/V; 8 rows of 32
new tokens over 400 cached: 1.6 vs 3.05; benchmarks/bench_cpu_extend.py). With both, every row
of a step is native: decode rows through the first, extend rows through the second. Without
the extend kernel (it did not build), extend rows of at most `max_extend_pairs` (query, key)
pairs go through the decode kernel one query at a time (query i over the row's first
prefix + i + 1 keys) and larger ones to SDPA (NATIVE_MAX_EXTEND_PAIRS gives the measurement).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from radixrt.attention.forward_batch import ForwardBatch
from radixrt.kernels.paged_decode_cpu import PagedDecodeKernel
from radixrt.kernels.paged_extend_cpu import PagedExtendKernel

# Extend rows of at most this many (query, key) pairs go through the native kernel. 8 such
# rows beside 24 decode rows, head_dim 32, one thread, native vs SDPA groups: on a 400-key
# prefix 4 new tokens (1.6k pairs) 0.54 vs 0.95 ms, 16 (6.5k) 2.04 vs 2.27, 32 (13k) 3.70 vs
# 3.14, 64 (28k) 6.79 vs 5.47; fresh rows of 64 (2.1k) 0.79 vs 1.23, 128 (8.3k) 2.21 vs
# 3.42; on 2000 keys 32 new (65k) 14.7 vs 11.4.
NATIVE_MAX_EXTEND_PAIRS = 8192
# Steps with at least this many (query, key) pairs split the kernel's queries over torch's
# threads (its OpenMP region runs on torch's own pool). Tiny Llama, 32 decode rows x ~150
# keys, 2 threads, decode step medians: 4.8-7.0 ms threaded vs 6.2-8.5 ms on one thread.
NATIVE_MIN_PAIRS_THREADED = 4096


class ExtendRows(NamedTuple):
    """The extend rows the extend kernel attends (its per-row inputs)."""

    block_start: torch.Tensor  # [E] int64: index into kv_indices of each row's blocks
    kv_len: torch.Tensor  # [E] int32: the row's keys after the step (cached + new)
    q_start: torch.Tensor  # [E] int64: the row's first new token in the step's T
    q_len: torch.Tensor  # [E] int32: its new tokens
    num_pairs: int  # (query, key) pairs of the causal rows in all


class NativePlan(NamedTuple):
    rows: np.ndarray  # [R] bool: rows the kernels attend (the others go to the SDPA groups)
    num_queries: int  # m: the decode kernel's queries (decode rows' tokens, small extends')
    token_index: torch.Tensor | None  # [m] int64: those tokens in the step's T, in order;
    # None when they are exactly tokens 0..m-1 (read and written in place)
    block_start: torch.Tensor  # [m] int64: index into kv_indices of each query's row's blocks
    kv_len: torch.Tensor  # [m] int32: keys each query attends
    num_pairs: int  # the decode kernel's (query, key) pairs in all: the sum of kv_len
    extend: ExtendRows | None = None  # rows through the extend kernel (None: no such row)


def plan_native(
    batch: ForwardBatch, max_extend_pairs: int, extend_kernel: bool = False
) -> NativePlan | None:
    """The kernels' share of `batch`: every decode row, and with `extend_kernel` every extend
    row (through the extend kernel), else the extend rows whose queries attend at most
    `max_extend_pairs` (query, key) pairs in all (through the decode kernel); None if that is
    no row."""
    if batch.num_decode == batch.num_rows:  # decode rows only: one query per row, in order
        return _decode_rows(batch)
    qo = batch.qo_indptr_cpu.numpy().astype(np.int64)
    seq = batch.seq_lens_cpu.numpy().astype(np.int64)
    kvp = batch.kv_indptr_cpu.numpy().astype(np.int64)
    q_len = qo[1:] - qo[:-1]
    pairs = q_len * (seq - q_len) + q_len * (q_len + 1) // 2  # sum over t of prefix + t + 1
    if extend_kernel:
        nd = batch.num_decode
        extend = ExtendRows(
            block_start=torch.from_numpy(kvp[nd:-1]),
            kv_len=torch.from_numpy(seq[nd:].astype(np.int32)),
            q_start=torch.from_numpy(qo[nd:-1]),
            q_len=torch.from_numpy(q_len[nd:].astype(np.int32)),
            num_pairs=int(pairs[nd:].sum()),
        )
        if nd == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return NativePlan(
                np.ones(batch.num_rows, dtype=bool), 0, None, empty, empty.int(), 0, extend
            )
        return _decode_rows(batch, nd)._replace(
            rows=np.ones(batch.num_rows, dtype=bool), extend=extend
        )
    rows = pairs <= max_extend_pairs
    rows[: batch.num_decode] = True
    sel = np.flatnonzero(rows)
    if sel.shape[0] == 0:
        return None
    lens = q_len[sel]
    m = int(lens.sum())
    tok_row = np.repeat(sel, lens)
    offset = np.arange(m) - np.repeat(np.cumsum(lens) - lens, lens)  # within the row's new
    token = qo[tok_row] + offset
    kv_len = (seq - q_len)[tok_row] + offset + 1
    in_place = bool(token[-1] == m - 1)  # tokens are increasing: 0..m-1 iff the last is m-1
    return NativePlan(
        rows=rows,
        num_queries=m,
        token_index=None if in_place else torch.from_numpy(token),
        block_start=torch.from_numpy(kvp[tok_row]),
        kv_len=torch.from_numpy(kv_len.astype(np.int32)),
        num_pairs=int(kv_len.sum()),
    )


def _decode_rows(batch: ForwardBatch, n: int | None = None) -> NativePlan:
    """The first n rows (all by default), decode rows: one query each, tokens 0..n-1."""
    n = batch.num_rows if n is None else n
    seq = batch.seq_lens_cpu[:n]
    return NativePlan(
        rows=np.ones(n, dtype=bool),
        num_queries=n,
        token_index=None,
        block_start=batch.kv_indptr_cpu[:n].to(torch.int64),
        kv_len=seq.contiguous(),
        num_pairs=int(seq.sum()),
    )


def attend_native(
    kernel: PagedDecodeKernel,
    plan: NativePlan,
    batch: ForwardBatch,
    q: torch.Tensor,  # [T, hq, d] float32 cpu (rows may be strided)
    k_cache: torch.Tensor,  # [num_blocks, block_size, hkv, d] float32 cpu: this layer's
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,  # [>= T, hq, d] float32: the plan's tokens are written
    extend_kernel: PagedExtendKernel | None = None,  # needed when plan.extend is set
) -> None:
    """The plan's queries through the kernels, into their rows of `out` (the decode kernel's
    in place when they are tokens 0..m-1, else gathered and scattered; the extend kernel's
    always in place). Raises ValueError for a non-float32 model or pool (the backend must
    then be built without native_decode)."""
    if k_cache.dtype != torch.float32 or q.dtype != torch.float32:
        raise ValueError(
            f"native_decode needs a float32 model and KV pool, got {q.dtype} / "
            f"{k_cache.dtype}; build the backend with native_decode=False"
        )
    ext = plan.extend
    if ext is not None:
        assert extend_kernel is not None
        threads = torch.get_num_threads() if ext.num_pairs >= NATIVE_MIN_PAIRS_THREADED else 1
        extend_kernel(
            q, k_cache, v_cache, batch.kv_indices, ext.block_start, ext.kv_len, ext.q_start,
            ext.q_len, scale, out[: q.shape[0]], num_threads=threads,
        )  # fmt: skip
    m, index = plan.num_queries, plan.token_index
    if m == 0:
        return
    args = (k_cache, v_cache, batch.kv_indices, plan.block_start, plan.kv_len, scale)
    threads = torch.get_num_threads() if plan.num_pairs >= NATIVE_MIN_PAIRS_THREADED else 1
    if index is None:
        kernel(q[:m], *args, out[:m], num_threads=threads)
        return
    res = q.new_empty((m, *q.shape[1:]))
    kernel(q.index_select(0, index), *args, res, num_threads=threads)
    out.index_copy_(0, index, res)
