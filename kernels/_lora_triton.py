"""Triton kernels of `radixrt.kernels.lora`; imported on first launch (see _triton.py).

Both kernels run one program per (tile, block of output columns). A tile is up to BLOCK_M
adapted tokens of one slot (`LoraSegments`), so every program reads one slot's weights and
multiplies them with tl.dot over its tokens: prefill segments and decode rows alike. An
empty tile (start == end, the padding of a CUDA graph's segments) returns at once, before
it reads a token or a weight.
"""

import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [T, in]: every token of the batch
    a_ptr,  # [in, L * C]: slot s's columns are [s * C, (s + 1) * C)
    y_ptr,  # [N, C], written: row j is token token_index[j]'s product
    token_index_ptr,  # [N] int32: the adapted tokens by slot (what no tile covers: unread)
    tile_start_ptr,  # [NT] int32: first position in token_index
    tile_end_ptr,  # [NT] int32: one past the last
    tile_slot_ptr,  # [NT] int32
    stride_x,
    stride_a,
    stride_y,
    in_features,
    cols_per_slot,  # C
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start >= end:  # an empty tile: a CUDA graph's padding
        return
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(token_index_ptr + offs_m, mask_m, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < cols_per_slot
    cols = slot * cols_per_slot + offs_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < in_features
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + offs_k[:, None].to(tl.int64) * stride_a + cols[None, :],
            mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += tl.dot(x, a, input_precision=INPUT_PRECISION)
    tl.store(
        y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def lora_expand_kernel(
    y_ptr,  # [N, R]: the shrunk rows, in token_index order
    b_ptr,  # [L * R, out]: slot s's rows are [s * R, (s + 1) * R)
    out_ptr,  # [T, out], read and written: out[token] += y[j] @ b[slot rows]
    token_index_ptr,
    tile_start_ptr,
    tile_end_ptr,
    tile_slot_ptr,
    stride_y,
    stride_b,
    stride_out,
    out_features,
    rank,  # R
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start >= end:  # an empty tile: a CUDA graph's padding
        return
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(token_index_ptr + offs_m, mask_m, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < rank
        y = tl.load(
            y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_k[None, :],
            mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + (slot * rank + offs_k[:, None]) * stride_b + offs_n[None, :],
            mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += tl.dot(y, b, input_precision=INPUT_PRECISION)
    # each token lies in one tile, so this read-add-write races with no other program
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    base = tl.load(out_ptrs, mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask)
