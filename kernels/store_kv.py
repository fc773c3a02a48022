"""Write new tokens' K and V into one layer of the paged KV pool.

`kv_layer` is `KVPool.kv[layer]`: `[2, num_blocks, block_size, kv_heads, head_dim]`, K at
index 0 and V at 1. A token's flat slot is `block * block_size + offset`.
"""

import torch

from ._triton import cdiv, load_triton_module, next_power_of_2

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: larger magnitudes would become NaN


def _check_args(kv_layer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    if kv_layer.dim() != 5 or kv_layer.shape[0] != 2:
        raise ValueError(
            f"kv_layer must be [2, num_blocks, block_size, H, D], got {tuple(kv_layer.shape)}"
        )
    if slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"slots must be [T] int64, got {tuple(slots.shape)} {slots.dtype}")
    expected = (slots.shape[0], *kv_layer.shape[3:])
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must be [T, H, D] = {expected}, got {tuple(t.shape)}")
    devices = {kv_layer.device, slots.device, k.device, v.device}
    if len(devices) != 1:
        raise ValueError(f"kv_layer, slots, k and v must share one device, got {devices}")


def store_kv(
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write k/v of T tokens at their flat slots; mutates `kv_layer` in place.

    kv_layer: [2, num_blocks, block_size, H, D] float32 | bfloat16 | float16 | float8_e4m3fn,
              any device (`KVPool.kv[layer]`; its last dim must be contiguous). fp8 stores
              `clamp(x / scale, +-448)` (computed in float32 as x * (1 / scale), rounded to
              nearest); the scales are ignored for other dtypes.
    slots:    [T] int64, same device: flat slot `block * block_size + offset` of each token.
              Must lie in [0, num_blocks * block_size) and be distinct; neither is checked
              (that would need a host sync), so out-of-range slots write out of bounds.
    k, v:     [T, H, D], same device; any float dtype (cast to kv_layer's dtype); token and
              head strides may be arbitrary (e.g. views into a fused qkv), last dim stride 1.
    T = 0 launches nothing.
    """
    _check_args(kv_layer, slots, k, v)
    if kv_layer.stride(-1) != 1:
        raise ValueError("kv_layer's last dim (head_dim) must be contiguous")
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _, _, block_size, num_heads, head_dim = kv_layer.shape
    block_d = next_power_of_2(head_dim)
    # About 4K elements a program: all heads of one token for small models.
    block_h = min(next_power_of_2(num_heads), max(1, 4096 // block_d))
    grid = (num_tokens, cdiv(num_heads, block_h))
    quant = kv_layer.dtype == torch.float8_e4m3fn
    kernel = load_triton_module("_store_kv_triton").store_kv_kernel
    kernel[grid](
        kv_layer,
        slots,
        k,
        v,
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        num_heads,
        head_dim,
        block_size,
        1.0 / k_scale,
        1.0 / v_scale,
        QUANT=quant,
        FP8_MAX=FP8_E4M3_MAX,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )


def store_kv_reference(
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Torch version of `store_kv` (same contract; kv_layer must be viewable as flat slots)."""
    _check_args(kv_layer, slots, k, v)
    flat = kv_layer.view(2, -1, *kv_layer.shape[3:])  # [2, num_blocks * block_size, H, D]
    if kv_layer.dtype != torch.float8_e4m3fn:
        flat[0].index_copy_(0, slots, k.to(flat.dtype))
        flat[1].index_copy_(0, slots, v.to(flat.dtype))
        return
    flat = flat.view(torch.uint8)  # no fp8 index_copy_ on CPU: copy the bytes
    for i, (x, scale) in enumerate(((k, k_scale), (v, v_scale))):
        x = (x.float() * (1.0 / scale)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        flat[i].index_copy_(0, slots, x.to(torch.float8_e4m3fn).view(torch.uint8))
