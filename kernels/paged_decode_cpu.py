"""Decode attention over the paged KV pool on a CPU, read in place (native kernel).

`paged_decode` attends each query token over the first `kv_len[t]` keys of its row, the keys
read block by block from the pool through the row's block table: no gathered copy of K/V.
The kernel (csrc/paged_decode.c, built by `radixrt.kernels.native`) takes float32 only;
`load_paged_decode()` is None where it cannot be built, and callers keep their torch path.
`paged_decode_reference` is the torch oracle the tests compare it with.
"""

from __future__ import annotations

import functools

import torch

from radixrt.kernels.native import NativeFunction, bind


class PagedDecodeKernel:
    """The loaded kernel; see `__call__`."""

    def __init__(self, fn: NativeFunction) -> None:
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,  # [n, hq, d] float32 cpu; rows may be strided, [hq, d] contiguous
        k_cache: torch.Tensor,  # [num_blocks, block_size, hkv, d] float32 cpu, contiguous
        v_cache: torch.Tensor,  # same
        kv_indices: torch.Tensor,  # [nnz] int32 cpu contiguous: concatenated block tables
        block_start: torch.Tensor,  # [n] int64 cpu contiguous: query t's blocks start here
        kv_len: torch.Tensor,  # [n] int32 cpu contiguous: keys query t attends (>= 1)
        scale: float,
        out: torch.Tensor,  # [n, hq, d] float32 cpu, written; rows may be strided
        lse: torch.Tensor | None = None,  # [n, hq] float32 contiguous: natural log-sum-exp
        # (to merge with another key set's partial result; the backend does not ask for it)
        num_threads: int = 1,
    ) -> None:
        """Query head i of token t attends kv head i // (hq / hkv) over keys 0..kv_len[t]-1
        of its row (no mask beyond that: a decode token sees its whole row). Writes `out`
        (and `lse`). The caller keeps every tensor alive and unchanged during the call
        (it returns when done). Raises RuntimeError if the kernel reports an error (also a
        query whose blocks are outside kv_indices or the pool: nothing is read)."""
        n, hq, d = q.shape
        _, bs, hkv, dk = k_cache.shape
        assert dk == d and hq % hkv == 0 and q.dtype == k_cache.dtype == torch.float32
        assert q.stride(2) == 1 and q.stride(1) == d and out.stride(2) == 1 and out.stride(1) == d
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and kv_indices.is_contiguous()
        assert block_start.dtype == torch.int64 and kv_len.dtype == torch.int32
        assert kv_indices.dtype == torch.int32 and block_start.shape[0] == kv_len.shape[0] == n
        assert lse is None or (lse.is_contiguous() and lse.dtype == torch.float32)
        if n == 0:
            return
        self._fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kv_indices.data_ptr(),
            block_start.data_ptr(),
            kv_len.data_ptr(),
            out.data_ptr(),
            None if lse is None else lse.data_ptr(),
            n,
            q.stride(0),
            out.stride(0),
            hkv,
            hq // hkv,
            d,
            bs,
            scale,
            kv_indices.numel(),
            k_cache.shape[0],
            num_threads,
        )


@functools.cache
def load_paged_decode(defines: tuple[str, ...] = ()) -> PagedDecodeKernel | None:
    """The kernel, built on first use; None if it cannot be (see radixrt.kernels.native).
    `defines`: macros the source reads (tests: RADIXRT_PORTABLE, RADIXRT_NO_OPENMP)."""
    fn = bind("paged_decode", "radixrt_paged_decode_f32", "ppppppppqqqiiiifqqi", defines)
    return None if fn is None else PagedDecodeKernel(fn)


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    block_start: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, one query at a time in float64: ([n, hq, d], lse [n, hq])."""
    n, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    out = torch.empty(n, hq, d, dtype=torch.float64)
    lse = torch.empty(n, hq, dtype=torch.float64)
    for t in range(n):
        length = int(kv_len[t])
        nblk = -(-length // bs)
        start = int(block_start[t])
        blocks = kv_indices[start : start + nblk].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:length].double()  # [L, hkv, d]
        v = v_cache[blocks].reshape(-1, hkv, d)[:length].double()
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [L, hq, d]
        s = torch.einsum("hd,lhd->hl", q[t].double(), k) * scale
        lse[t] = torch.logsumexp(s, dim=1)
        out[t] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=1), v)
    return out, lse
