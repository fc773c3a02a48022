"""Paged KV memory: one tensor holding K and V of every layer.

Layout: `kv[layer, 0 | 1, block, offset, kv_head, head_dim]` (FlashInfer NHD per
layer). The token at absolute position p of a request lives in
`block_table[p // block_size]` at offset `p % block_size`; its flat slot is
`block * block_size + offset`.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # [L, 2, num_blocks, block_size, kv_heads, head_dim]
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elt = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elt

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]  # [num_blocks, block_size, kv_heads, head_dim]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V. slots: [T] int64; k, v: [T, kv_heads, head_dim]."""
        flat = self.kv[layer].view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, slots, k.to(flat.dtype))
        flat[1].index_copy_(0, slots, v.to(flat.dtype))

    def copy_prefix(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        """Copy-on-write: the first `num_tokens` tokens of a block, every layer, K and V."""
        assert 0 < num_tokens <= self.block_size
        self.kv[:, :, dst_block, :num_tokens] = self.kv[:, :, src_block, :num_tokens]
