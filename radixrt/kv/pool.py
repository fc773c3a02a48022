"""Paged KV memory: one tensor holding K and V of every layer.

Layout: `kv[layer, 0 | 1, block, offset, kv_head, head_dim]` (FlashInfer NHD per
layer). The token at absolute position p of a request lives in
`block_table[p // block_size]` at offset `p % block_size`; its flat slot is
`block * block_size + offset`.

Storage dtype: the model's dtype, or float8_e4m3fn (`kv_cache_dtype="fp8_e4m3"`) with one
K and one V scale per layer (`KVScales`): `store` writes `clamp(x / scale, +-448)` in fp8,
and a reader dequantizes with `dequantize` (torch backends) or passes the scales to its
kernel (FlashInfer). fp8 elements are 1 byte, so the same memory holds twice the tokens of
bf16 (`bytes_per_block`).
"""

from __future__ import annotations

import torch

from radixrt.kv.scales import FP8_E4M3_MAX, KVScales

FP8_DTYPE = torch.float8_e4m3fn


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element dtype for `CacheConfig.kv_cache_dtype` ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {kv_cache_dtype!r}")


def num_blocks_for_memory(
    free_bytes: int, total_bytes: int, mem_fraction: float, bytes_per_block: int
) -> int:
    """Blocks that fit in what is free once (1 - mem_fraction) of the whole device is kept
    for activations, graphs and workspace (may be <= 0: the caller raises)."""
    budget = free_bytes - (1.0 - mem_fraction) * total_bytes
    return int(budget // bytes_per_block)


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
        scales: KVScales | None = None,
    ) -> None:
        """`dtype`: the storage dtype (see `kv_storage_dtype`). `scales`: fp8 only (default
        1.0 for every layer); a non-fp8 pool stores values as they are and takes none."""
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.is_fp8 = dtype == FP8_DTYPE
        if not self.is_fp8 and scales is not None:
            raise ValueError(f"KV scales need an fp8 pool, got dtype {dtype}")
        self.scales = scales or KVScales.ones(num_layers)
        if self.scales.num_layers != num_layers:
            raise ValueError(
                f"KV scales cover {self.scales.num_layers} layers, the pool has {num_layers}"
            )
        # [L, 2, num_blocks, block_size, kv_heads, head_dim]
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )
        # per-layer views, made once (a decode step would otherwise make ~5 a layer)
        self._k = [self.kv[i, 0] for i in range(num_layers)]
        self._v = [self.kv[i, 1] for i in range(num_layers)]
        self._k_flat = [k.view(-1, num_kv_heads, head_dim) for k in self._k]
        self._v_flat = [v.view(-1, num_kv_heads, head_dim) for v in self._v]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def kv_cache_dtype(self) -> str:
        """The `CacheConfig.kv_cache_dtype` this pool realises ("fp8_e4m3" or a torch name)."""
        return "fp8_e4m3" if self.is_fp8 else str(self.dtype).removeprefix("torch.")

    @property
    def num_tokens(self) -> int:
        """Token capacity: blocks x block size."""
        return self.num_blocks * self.block_size

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """K and V of one block over every layer; fp8 is half of bf16."""
        elt = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elt

    def k_cache(self, layer: int) -> torch.Tensor:
        return self._k[layer]  # [num_blocks, block_size, kv_heads, head_dim] storage dtype

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def k_scale(self, layer: int) -> float:
        return self.scales.k[layer]

    def v_scale(self, layer: int) -> float:
        return self.scales.v[layer]

    def quantize(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [T, kv_heads, head_dim] any float -> the values `store` writes, in the pool's
        dtype (fp8: x * (1 / scale) in float32, clamped to +-448, rounded to nearest; the
        Triton `store_kv` computes the same)."""
        if not self.is_fp8:
            return k.to(self.dtype), v.to(self.dtype)
        out = []
        for x, scale in ((k, self.k_scale(layer)), (v, self.v_scale(layer))):
            x = x.float() if scale == 1.0 else x.float() * (1.0 / scale)  # as store_kv
            out.append(x.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE))
        return out[0], out[1]

    def dequantize(
        self, layer: int, keys: torch.Tensor, vals: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered stored K/V (any shape) -> values in `dtype` (fp8: times the layer's
        scales). Returns new tensors or, when nothing changes, the inputs."""
        keys, vals = keys.to(dtype), vals.to(dtype)
        if self.is_fp8:
            ks, vs = self.k_scale(layer), self.v_scale(layer)
            keys = keys if ks == 1.0 else keys * ks
            vals = vals if vs == 1.0 else vals * vs
        return keys, vals

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V (quantized as `quantize`). slots: [T] int64;
        k, v: [T, kv_heads, head_dim]. Mutates the pool."""
        k_flat, v_flat = self._k_flat[layer], self._v_flat[layer]
        kq, vq = self.quantize(layer, k, v)
        if self.is_fp8:  # index_copy_ has no fp8 kernel on CPU: copy the bytes
            k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
            kq, vq = kq.view(torch.uint8), vq.view(torch.uint8)
        k_flat.index_copy_(0, slots, kq)
        v_flat.index_copy_(0, slots, vq)

    def copy_prefix(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        """Copy-on-write: the first `num_tokens` tokens of a block, every layer, K and V
        (stored values as they are, so fp8 copies exactly)."""
        assert 0 < num_tokens <= self.block_size
        kv = self.kv.view(torch.uint8) if self.is_fp8 else self.kv  # fp8: copy the bytes
        kv[:, :, dst_block, :num_tokens] = kv[:, :, src_block, :num_tokens]
