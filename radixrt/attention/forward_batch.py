"""One model forward's inputs: flattened new tokens of a mixed decode/extend batch.

Rows (requests) are ordered decode rows first (one new token each), then extend rows
(prefill chunks, possibly on top of a cached prefix). Token i of the flattened batch
belongs to the row r with qo_indptr[r] <= i < qo_indptr[r + 1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixrt.lora.slots import LoraBatch


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
    # [1] int64, device: tokens [0, n) are real, the rest padding (a CUDA graph's bucket);
    # None: every token is real
    num_real_tokens: torch.Tensor | None = None
    lora: LoraBatch | None = None  # the rows' LoRA adapters (None: every row is the base's)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.seq_lens_cpu.shape[0]

    @property
    def num_extend(self) -> int:
        return self.num_rows - self.num_decode


def reference_batch(
    table: torch.Tensor,  # [R, >= blocks used] int32 cpu: each row's block table
    cached: torch.Tensor,  # [R] int32 cpu: tokens already in each row's KV
    new: torch.Tensor,  # [R] int32 cpu: new tokens of each row (decode rows first: 1 each)
    num_decode: int,
    block_size: int,
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """The ForwardBatch of these rows, built with the reference metadata builders (tests and
    benchmarks: the oracle the runner's fast builders are checked against). Input ids are 0;
    every row's last token is sampled."""
    from radixrt.kernels import build_kv_metadata_reference, build_token_metadata_reference

    seq_lens = cached + new
    qo = torch.zeros(len(new) + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(new, 0)
    num_tokens = int(qo[-1])
    kv = build_kv_metadata_reference(table, seq_lens, block_size)
    tok = build_token_metadata_reference(table, cached, new, qo, num_tokens, block_size)
    dev = torch.device(device)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
        positions=tok.positions.to(dev),
        slot_mapping=tok.slot_mapping.to(dev),
        qo_indptr=qo.to(dev),
        kv_indptr=kv.kv_indptr.to(dev),
        kv_indices=kv.kv_indices.to(dev),
        kv_last_page_len=kv.kv_last_page_len.to(dev),
        seq_lens=seq_lens.to(dev),
        logits_indices=(qo[1:] - 1).long().to(dev),
        num_decode=num_decode,
        qo_indptr_cpu=qo,
        seq_lens_cpu=seq_lens,
        kv_indptr_cpu=kv.kv_indptr,
        block_size=block_size,
    )
