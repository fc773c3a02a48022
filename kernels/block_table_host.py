"""Attention metadata built on the host with numpy: what the runner uses on non-CUDA devices.

The same results as `build_kv_metadata_vectorized` / `build_token_metadata_vectorized` (and
their references), from numpy arrays: a numpy op on a [32]-element array costs ~1 us where a
torch op costs 3-5 us, and a CPU decode step builds this metadata every step. No checks (the
"must"s of `radixrt.kernels.build_kv_metadata` / `build_token_metadata` hold for the caller).
Results are CPU tensors sharing the numpy arrays' memory (`torch.from_numpy`).
"""

import numpy as np
import torch

from .block_table import KVMetadata, TokenMetadata


def build_kv_metadata_host(
    block_tables: np.ndarray,  # [R, max_blocks] int32: padded block tables
    seq_lens: np.ndarray,  # [R] int32: KV length of each row (1..max_blocks * B)
    block_size: int,
) -> KVMetadata:
    """KV indptr [R + 1] int32, the used blocks of each row in row order [nnz] int32 and
    each row's tokens in its last block [R] int32, as CPU tensors."""
    num_blocks = (seq_lens + (block_size - 1)) // block_size
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(num_blocks, out=indptr[1:])
    used = np.arange(block_tables.shape[1], dtype=np.int32) < num_blocks[:, None]
    last = (seq_lens - (num_blocks - 1) * block_size).astype(np.int32, copy=False)
    indices = np.ascontiguousarray(block_tables[used], dtype=np.int32)
    return KVMetadata(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last))


def build_token_metadata_host(
    block_tables: np.ndarray,  # [R, max_blocks] int32
    start_pos: np.ndarray,  # [R] int32: tokens of the row already in KV
    num_new: np.ndarray,  # [R] int32: new tokens of the row (0 allowed)
    qo_indptr: np.ndarray,  # [R + 1] int32: prefix sums of num_new
    block_size: int,
) -> TokenMetadata:
    """Positions and flat KV slots of the new tokens [T] int64 (CPU tensors); token j of row
    r is at position start_pos[r] + j, in block block_tables[r, p // B] at offset p % B."""
    num_rows = len(num_new)
    num_tokens = int(qo_indptr[-1])
    rows = np.repeat(np.arange(num_rows), num_new)  # [T]: the row of each new token
    offset = np.arange(num_tokens, dtype=np.int64) - qo_indptr[rows]
    positions = start_pos[rows] + offset
    blocks = block_tables[rows, positions // block_size].astype(np.int64)
    slots = blocks * block_size + positions % block_size
    return TokenMetadata(torch.from_numpy(positions), torch.from_numpy(slots))
