"""One model forward's inputs: flattened new tokens of a mixed decode/extend batch.

Rows (requests) are ordered decode rows first (one new token each), then extend rows
(prefill chunks, possibly on top of a cached prefix). Token i of the flattened batch
belongs to the row r with qo_indptr[r] <= i < qo_indptr[r + 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, device: absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64, device: flat KV slot (block * B + offset)
    qo_indptr: torch.Tensor  # [R + 1] int32, device
    kv_indptr: torch.Tensor  # [R + 1] int32, device: row r's blocks are kv_indices[a:b]
    kv_indices: torch.Tensor  # [nnz_blocks] int32, device: block tables, concatenated
    kv_last_page_len: torch.Tensor  # [R] int32, device: tokens in each row's last block (1..B)
    seq_lens: torch.Tensor  # [R] int32, device: KV length after this step (cached + new)
    logits_indices: torch.Tensor  # [S] int64, device: tokens whose logits are sampled
    num_decode: int  # rows [0, num_decode) are decode rows (q_len 1)
    qo_indptr_cpu: torch.Tensor  # [R + 1] int32, cpu
    seq_lens_cpu: torch.Tensor  # [R] int32, cpu
    kv_indptr_cpu: torch.Tensor  # [R + 1] int32, cpu
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.seq_lens_cpu.shape[0]

    @property
    def num_extend(self) -> int:
        return self.num_rows - self.num_decode

    @property
    def num_decode_tokens(self) -> int:
        """Decode rows come first, one token each."""
        return self.num_decode
