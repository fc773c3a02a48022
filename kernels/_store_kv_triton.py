"""Triton kernel of `radixrt.kernels.store_kv`; imported on first launch (see _triton.py)."""

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
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
    k_inv_scale,  # float: multiplies K before the cast when QUANT
    v_inv_scale,
    QUANT: tl.constexpr,  # fp8 pool: x * inv_scale in float32, clamped to +-FP8_MAX
    FP8_MAX: tl.constexpr,
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
    if QUANT:
        k = tl.minimum(tl.maximum(k.to(tl.float32) * k_inv_scale, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * v_inv_scale, -FP8_MAX), FP8_MAX)
    tl.store(kv_ptr + dst, k.to(kv_ptr.dtype.element_ty), mask)
    tl.store(kv_ptr + stride_kv_kv + dst, v.to(kv_ptr.dtype.element_ty), mask)
