"""Causal extend (prefill) attention over the paged KV pool on a CPU, read in place (native).

`PagedExtendKernel` attends each row's new tokens (its last `q_len[r]` of `kv_len[r]` keys,
their K/V already stored in the pool) causally over the row's keys, read block by block
through the row's block table: no gathered copy of K/V. Queries are tiled so that each key
is loaded once per tile of query vectors, not once per query (csrc/paged_extend.c, built by
`radixrt.kernels.native`); float32 only. `load_paged_extend()` is None where it cannot be
built (callers keep their torch path). `paged_extend_reference` is the float64 torch oracle
the tests compare it with.
"""

from __future__ import annotations

import functools

import torch

from radixrt.kernels.native import NativeFunction, bind


class PagedExtendKernel:
    """The loaded kernel; see `__call__`."""

    def __init__(self, fn: NativeFunction) -> None:
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,  # [T, hq, d] float32 cpu; token rows may be strided, [hq, d] contiguous
        k_cache: torch.Tensor,  # [num_blocks, block_size, hkv, d] float32 cpu, contiguous
        v_cache: torch.Tensor,  # same
        kv_indices: torch.Tensor,  # [nnz] int32 cpu contiguous: concatenated block tables
        block_start: torch.Tensor,  # [R] int64 cpu contiguous: row r's blocks start here
        kv_len: torch.Tensor,  # [R] int32 cpu contiguous: row r's keys (>= q_len[r])
        q_start: torch.Tensor,  # [R] int64 cpu contiguous: row r's first query token in q
        q_len: torch.Tensor,  # [R] int32 cpu contiguous: row r's queries (>= 1)
        scale: float,
        out: torch.Tensor,  # [T, hq, d] float32 cpu, written at the rows' tokens; may be strided
        lse: torch.Tensor | None = None,  # [T, hq] float32 contiguous: natural log-sum-exp
        num_threads: int = 1,
    ) -> None:
        """Row r's query i (token q_start[r] + i, 0 <= i < q_len[r]) attends keys
        0 .. kv_len[r] - q_len[r] + i of the row (causal: its new tokens are the row's last
        q_len[r] keys); query head j reads kv head j // (hq / hkv). Writes `out` (and `lse`)
        at the rows' tokens only; other tokens are left as they were. Rows need not be in
        token order; two rows must not share a token. The caller keeps every tensor alive
        and unchanged during the call (it returns when done). Raises RuntimeError if the
        kernel reports an error (bad lengths, a token or block out of range)."""
        t, hq, d = q.shape
        nb, bs, hkv, dk = k_cache.shape
        assert dk == d and hq % hkv == 0 and q.dtype == k_cache.dtype == torch.float32
        assert v_cache.shape == k_cache.shape and v_cache.dtype == torch.float32
        assert out.shape == q.shape and out.dtype == torch.float32
        assert q.stride(2) == 1 and q.stride(1) == d and out.stride(2) == 1 and out.stride(1) == d
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and kv_indices.is_contiguous()
        assert kv_indices.dtype == torch.int32 and kv_len.dtype == q_len.dtype == torch.int32
        assert block_start.dtype == q_start.dtype == torch.int64
        n = block_start.shape[0]
        assert kv_len.shape == q_start.shape == q_len.shape == (n,)
        for x in (block_start, kv_len, q_start, q_len):
            assert x.is_contiguous() and x.device.type == "cpu"
        assert lse is None or (
            lse.is_contiguous() and lse.dtype == torch.float32 and lse.shape == (t, hq)
        )
        if n == 0:
            return
        self._fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kv_indices.data_ptr(),
            block_start.data_ptr(),
            kv_len.data_ptr(),
            q_start.data_ptr(),
            q_len.data_ptr(),
            out.data_ptr(),
            None if lse is None else lse.data_ptr(),
            n,
            t,
            kv_indices.shape[0],
            nb,
            q.stride(0),
            out.stride(0),
            hkv,
            hq // hkv,
            d,
            bs,
            scale,
            num_threads,
        )


@functools.cache
def load_paged_extend(defines: tuple[str, ...] = ()) -> PagedExtendKernel | None:
    """The kernel, built on first use; None if it cannot be (see radixrt.kernels.native).
    `defines`: macros the source reads (tests: RADIXRT_PORTABLE, RADIXRT_NO_OPENMP)."""
    fn = bind("paged_extend", "radixrt_paged_extend_f32", "ppppppppppqqqqqqiiiifi", defines)
    return None if fn is None else PagedExtendKernel(fn)


def paged_extend_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    block_start: torch.Tensor,
    kv_len: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, one row at a time in float64 (keys gathered, causal mask,
    softmax): (out [T, hq, d], lse [T, hq]); tokens of no row are NaN."""
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    out = torch.full((t, hq, d), float("nan"), dtype=torch.float64)
    lse = torch.full((t, hq), float("nan"), dtype=torch.float64)
    for r in range(block_start.shape[0]):
        length, n, s0 = int(kv_len[r]), int(q_len[r]), int(q_start[r])
        start = int(block_start[r])
        blocks = kv_indices[start : start + -(-length // bs)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:length].double()  # [L, hkv, d]
        v = v_cache[blocks].reshape(-1, hkv, d)[:length].double()
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [L, hq, d]
        s = torch.einsum("nhd,lhd->hnl", q[s0 : s0 + n].double(), k) * scale  # [hq, n, L]
        keys = torch.arange(length)
        bound = length - n + torch.arange(n)  # query i's last key
        s = s.masked_fill(keys[None, :] > bound[:, None], float("-inf"))
        lse[s0 : s0 + n] = torch.logsumexp(s, dim=2).T
        out[s0 : s0 + n] = torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=2), v)
    return out, lse
