"""Rotary embedding of q and k fused with the store of k and v into the paged KV pool.

One pass replaces the RoPE kernel and `store_kv`: q is rotated in place for attention, and
rotated k and v are written at their flat slots of `KVPool.kv[layer]` (see store_kv.py),
quantized for an fp8 pool. Attention then reads k and v from the pool only (FlashInfer's
paged kernels do). Neox-style rotation (HF Llama/Qwen `rotate_half`) from a float32
cos | sin cache, which carries any frequency scaling (llama3, linear: rope_inv_freq).
"""

import torch

from ._triton import cdiv, load_triton_module, next_power_of_2
from .store_kv import FP8_E4M3_MAX, store_kv_reference

PROGRAM_ELEMENTS = 2048  # head-half elements a program rotates (BLOCK_H x BLOCK_HALF)


def _check_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[::2] != k.shape[::2]:
        raise ValueError(
            "q must be [T, Hq, d] and k, v [T, Hkv, d], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    num_tokens, head_dim = q.shape[0], q.shape[2]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.dtype != torch.float32:
        raise ValueError(
            f"cos_sin must be [max_positions, {head_dim}] float32, got "
            f"{tuple(cos_sin.shape)} {cos_sin.dtype}"
        )
    for name, t in (("positions", positions), ("slots", slots)):
        if t.shape != (num_tokens,) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be [{num_tokens}] int64, got {tuple(t.shape)} {t.dtype}")
    if (
        kv_layer.dim() != 5
        or kv_layer.shape[0] != 2
        or kv_layer.shape[3] != k.shape[1]
        or kv_layer.shape[4] < head_dim
    ):
        raise ValueError(
            f"kv_layer must be [2, num_blocks, block_size, {k.shape[1]}, >= {head_dim}], got "
            f"{tuple(kv_layer.shape)}"
        )
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {t.device for t in (q, k, v, positions, cos_sin, kv_layer, slots)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must share one device, got {devices}")


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Rotate q in place; write rotate(k) and v at `slots` of `kv_layer`. k, v not mutated.

    q:         [T, Hq, d] float32 | bfloat16 | float16, any device; token and head strides
               free (views of a merged qkv output), last dim contiguous.
    k, v:      [T, Hkv, d], q's dtype and device, same stride rules.
    positions: [T] int64: each token's position (row of cos_sin).
    cos_sin:   [max_positions, d] float32: cos | sin of each position's angles.
    kv_layer:  [2, num_blocks, block_size, Hkv, D] (`KVPool.kv[layer]`), D >= d, last dim
               contiguous; columns [d, D) are written as zeros (a pool padded for the
               attention kernel). fp8 stores clamp(x / scale, +-448) as store_kv does.
    slots:     [T] int64: flat slots, distinct and in range (not checked: a host sync).
    Rotation in float32; rotated q and k are rounded to q's dtype (k before quantizing).
    T = 0 launches nothing.
    """
    _check_args(q, k, v, positions, cos_sin, kv_layer, slots)
    if any(t.stride(-1) != 1 for t in (q, kv_layer, cos_sin)):
        raise ValueError("q, kv_layer and cos_sin must have a contiguous last dim")
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    num_kv_heads, block_size, pad = k.shape[1], kv_layer.shape[2], kv_layer.shape[4] - head_dim
    block_half = next_power_of_2(head_dim // 2)
    block_h = min(next_power_of_2(num_kv_heads), max(1, PROGRAM_ELEMENTS // block_half))
    num_q_programs = cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_programs + cdiv(num_kv_heads, block_h))
    kernel = load_triton_module("_rope_store_kv_triton").rope_store_kv_kernel
    kernel[grid](
        q,
        k,
        v,
        positions,
        cos_sin,
        kv_layer,
        slots,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin.stride(0),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        num_q_heads,
        num_kv_heads,
        num_q_programs,
        block_size,
        1.0 / k_scale,
        1.0 / v_scale,
        HALF=head_dim // 2,
        PAD=pad,
        QUANT=kv_layer.dtype == torch.float8_e4m3fn,
        FP8_MAX=FP8_E4M3_MAX,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_PAD=next_power_of_2(pad) if pad else 1,
        num_warps=4,
    )


def rope_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of x [T, H, d] at `positions` in float32, rounded to x's dtype (new)."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, d / 2] each
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_store_kv_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Torch version of `rope_store_kv` (same contract and rounding)."""
    _check_args(q, k, v, positions, cos_sin, kv_layer, slots)
    q.copy_(rope_reference(q, positions, cos_sin))
    k = rope_reference(k, positions, cos_sin)
    pad = kv_layer.shape[4] - q.shape[2]
    if pad:
        k, v = (torch.nn.functional.pad(t, (0, pad)) for t in (k, v))
    store_kv_reference(kv_layer, slots, k, v, k_scale, v_scale)
