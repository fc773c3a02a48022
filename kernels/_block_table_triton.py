"""Triton kernel of `radixrt.kernels.block_table`; imported on first launch (see _triton.py)."""

import triton
import triton.language as tl

# Host ints that change from step to step (the padded table's width, the batch's token and
# index counts) are not specialised on: Triton would otherwise compile a variant for each
# value that is 1 or a multiple of 16, in the middle of serving (a radix cache's prefixes
# end anywhere, so its batches reach variants a block-aligned warm-up never does).
_PER_STEP = ["stride_bt_row", "max_blocks"]


@triton.jit(do_not_specialize=_PER_STEP + ["num_kv_indices"])
def kv_indices_kernel(
    block_tables_ptr,  # [R, max_blocks] int32
    seq_lens_ptr,  # [R] int32
    kv_indptr_ptr,  # [R + 1] int32
    kv_indices_ptr,  # [num_kv_indices] int32, written
    stride_bt_row,
    stride_bt_col,
    max_blocks,
    num_kv_indices,
    block_size,
    BLOCK: tl.constexpr,
):
    # One program per row; loads are kept inside the table and stores inside kv_indices
    # even when the caller broke the contract (seq_len > max_blocks * B, short nnz).
    row = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + row)
    num_blocks = tl.minimum((seq_len + block_size - 1) // block_size, max_blocks)
    start = tl.load(kv_indptr_ptr + row)
    src = block_tables_ptr + row.to(tl.int64) * stride_bt_row
    for i in range(0, num_blocks, BLOCK):
        idx = i + tl.arange(0, BLOCK)
        mask = (idx < num_blocks) & (start + idx < num_kv_indices)
        block_ids = tl.load(src + idx * stride_bt_col, mask)
        tl.store(kv_indices_ptr + start + idx, block_ids, mask)


@triton.jit(do_not_specialize=_PER_STEP + ["num_tokens"])
def token_metadata_kernel(
    block_tables_ptr,  # [R, max_blocks] int32
    start_pos_ptr,  # [R] int32
    num_new_ptr,  # [R] int32
    qo_indptr_ptr,  # [R + 1] int32
    positions_ptr,  # [T] int64, written
    slot_mapping_ptr,  # [T] int64, written
    stride_bt_row,
    stride_bt_col,
    max_blocks,
    num_tokens,
    block_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    start_pos = tl.load(start_pos_ptr + row).to(tl.int64)
    num_new = tl.load(num_new_ptr + row)
    out = tl.load(qo_indptr_ptr + row)
    src = block_tables_ptr + row.to(tl.int64) * stride_bt_row
    for i in range(0, num_new, BLOCK):
        j = i + tl.arange(0, BLOCK)
        mask = (j < num_new) & (out + j < num_tokens)
        pos = start_pos + j
        col = pos // block_size
        block = tl.load(src + col * stride_bt_col, mask & (col < max_blocks))
        slot = block.to(tl.int64) * block_size + pos % block_size
        tl.store(positions_ptr + out + j, pos, mask)
        tl.store(slot_mapping_ptr + out + j, slot, mask)


@triton.jit(do_not_specialize=["stride_table_row", "max_blocks"])
def block_table_kernel(
    kv_indptr_ptr,  # [R + 1] int32 or int64
    kv_indices_ptr,  # [nnz] int32
    table_ptr,  # [>= R, >= max_blocks] int32, written (unit column stride)
    stride_table_row,
    max_blocks,
    BLOCK: tl.constexpr,
):
    # One program per row: the inverse of kv_indices_kernel (concatenated ids -> table rows),
    # at most max_blocks entries per row.
    row = tl.program_id(0)
    start = tl.load(kv_indptr_ptr + row)
    num_blocks = tl.minimum(tl.load(kv_indptr_ptr + row + 1) - start, max_blocks)
    dst = table_ptr + row.to(tl.int64) * stride_table_row
    for i in range(0, num_blocks, BLOCK):
        idx = i + tl.arange(0, BLOCK)
        mask = idx < num_blocks
        tl.store(dst + idx, tl.load(kv_indices_ptr + start + idx, mask), mask)
