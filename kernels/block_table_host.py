"""Attention metadata built on the host with numpy: what the runner uses on non-CUDA devices.

The same results as `build_kv_metadata` / `build_token_metadata` (Triton, CUDA) and their
references, from numpy arrays, in as few array ops as possible: between two forwards of
a CPU decode step the caches are cold (the forward streams the weights and the KV), and there
every numpy or torch call costs 5-20 us, a torch op more than a numpy op. No checks (the
"must"s of `radixrt.kernels.build_kv_metadata` / `build_token_metadata` hold for the caller).
"""

from typing import NamedTuple

import numpy as np


class HostMetadata(NamedTuple):
    """A step's attention metadata as numpy arrays (fresh, the caller may wrap them)."""

    kv_indptr: np.ndarray  # [R + 1] int32: prefix sums of the rows' block counts
    kv_indices: np.ndarray  # [nnz] int32: the used blocks of each row, in row order
    kv_last_page_len: np.ndarray  # [R] int32: tokens in each row's last block, 1..B
    positions: np.ndarray  # [T] int64: absolute position of each new token
    slot_mapping: np.ndarray  # [T] int64: flat KV slot (block * B + offset) of each new token
    seq_lens: np.ndarray  # [R] int32: KV length of each row after the step


def build_host_metadata(
    tables: np.ndarray,  # [slots, max_blocks] int32: every slot's block table
    slots: np.ndarray,  # [R] int64: the slot of each row
    start_pos: np.ndarray,  # [R] int32: tokens of the row already in KV
    num_new: np.ndarray,  # [R] int32: new tokens of the row (0 allowed)
    qo_indptr: np.ndarray,  # [R + 1] int32: prefix sums of num_new
    block_size: int,
    num_decode: int = 0,  # leading rows known to feed one token each (may be 0)
) -> HostMetadata:
    """KV metadata of each row's sequence after the step (start_pos + num_new tokens) and the
    positions / slots of its new tokens: token j of row r is at p = start_pos[r] + j, in block
    tables[slots[r], p // B] at offset p % B."""
    num_rows = len(slots)
    seq_lens = start_pos + num_new
    num_blocks = (seq_lens + (block_size - 1)) // block_size
    indptr = np.zeros(num_rows + 1, dtype=np.int32)
    np.cumsum(num_blocks, out=indptr[1:])
    width = int(num_blocks.max()) if num_rows else 0
    rows_tables = tables[slots, :width]
    used = np.arange(width, dtype=np.int32) < num_blocks[:, None]
    last = seq_lens - (num_blocks - 1) * block_size
    if num_decode == num_rows:  # one token a row: row r's token is at start_pos[r]
        rows = np.arange(num_rows)
        positions = start_pos.astype(np.int64)
    else:
        rows = np.repeat(np.arange(num_rows), num_new)  # [T]: the row of each new token
        positions = start_pos[rows] + (np.arange(int(qo_indptr[-1])) - qo_indptr[rows])
    blocks = rows_tables[rows, positions // block_size].astype(np.int64)
    return HostMetadata(
        kv_indptr=indptr,
        kv_indices=rows_tables[used],
        kv_last_page_len=last.astype(np.int32, copy=False),
        positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        seq_lens=seq_lens,
    )
