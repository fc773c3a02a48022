"""AttentionBackend protocol: paged attention over a KVPool for a mixed batch."""

from __future__ import annotations

from typing import Protocol

import torch

from radixrt.attention.forward_batch import ForwardBatch
from radixrt.kv.pool import KVPool


class AttentionBackend(Protocol):
    supports_fp8_kv: bool  # attends over a float8_e4m3fn KV pool (checked at construction)
    supports_cuda_graph: bool  # its decode steps can be captured in CUDA graphs
    # head dim of the KV pool it attends over: the model's head_dim, or more where the
    # backend pads small heads (FlashInfer); the pool is allocated with it
    kv_head_dim: int

    def prepare(self, batch: ForwardBatch) -> None:
        """Plan the step (once per forward, before any layer runs)."""
        ...

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        pool: KVPool,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store the new K/V at batch.slot_mapping, then attend: each new token sees its
        row's cached prefix and the row's new tokens up to itself (causal)."""
        ...
