"""Write new tokens' K and V into one layer of the paged KV pool.

`kv_layer` is `KVPool.kv[layer]`: `[2, num_blocks, block_size, kv_heads, head_dim]`, K at
index 0 and V at 1. A token's flat slot is `block * block_size + offset`.
"""

import torch

from ._triton import tl, triton


@triton.jit
def _store_kv_kernel(
    kv_ptr,  # [2, num_blocks, block_size, H, D]
    slots_ptr,  # [T] int64
    k_ptr,  # [T, H, D]
    v_ptr,  # [T, H, D]
    stride_kv_kv,
    stride_kv_block,
    stride_kv_offset,
    stride_kv_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    num_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (token, block of BLOCK_H heads); the last dim of every tensor is
    # contiguous (stride 1, checked by the launcher).
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < head_dim)

    slot = tl.load(slots_ptr + token)
    block = slot // block_size
    offset = slot % block_size
    dst = block * stride_kv_block + offset * stride_kv_offset
    dst += heads[:, None] * stride_kv_head + dims[None, :]

    k = tl.load(k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask)
    v = tl.load(v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask)
    tl.store(kv_ptr + dst, k.to(kv_ptr.dtype.element_ty), mask)
    tl.store(kv_ptr + stride_kv_kv + dst, v.to(kv_ptr.dtype.element_ty), mask)


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


def store_kv(kv_layer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write k/v of T tokens at their flat slots; mutates `kv_layer` in place.

    kv_layer: [2, num_blocks, block_size, H, D] float32 | bfloat16 | float16, any device
              (`KVPool.kv[layer]`; its last dim must be contiguous).
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
    block_d = triton.next_power_of_2(head_dim)
    # About 4K elements a program: all heads of one token for small models.
    block_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _store_kv_kernel[grid](
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
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )


def store_kv_reference(
    kv_layer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Torch version of `store_kv` (same contract; kv_layer must be viewable as flat slots)."""
    _check_args(kv_layer, slots, k, v)
    flat = kv_layer.view(2, -1, *kv_layer.shape[3:])  # [2, num_blocks * block_size, H, D]
    flat[0].index_copy_(0, slots, k.to(flat.dtype))
    flat[1].index_copy_(0, slots, v.to(flat.dtype))
