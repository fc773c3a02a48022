"""Triton kernel of `radixrt.kernels.rope_store_kv`; imported on first launch (see _triton.py)."""

import triton
import triton.language as tl


@triton.jit
def rope_store_kv_kernel(
    q_ptr,  # [T, Hq, d], rotated in place
    k_ptr,  # [T, Hkv, d]
    v_ptr,  # [T, Hkv, d]
    positions_ptr,  # [T] int64
    cos_sin_ptr,  # [max_positions, d] float32: cos | sin halves
    kv_ptr,  # [2, num_blocks, block_size, Hkv, D], D >= d
    slots_ptr,  # [T] int64
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cos_sin,
    stride_kv_kv,
    stride_kv_block,
    stride_kv_offset,
    stride_kv_head,
    num_q_heads,
    num_kv_heads,
    num_q_programs,  # programs along axis 1 that rotate q; the rest store k and v
    block_size,
    k_inv_scale,  # float: multiplies K before the cast when QUANT
    v_inv_scale,
    HALF: tl.constexpr,  # d / 2
    PAD: tl.constexpr,  # D - d columns written as zeros
    QUANT: tl.constexpr,  # fp8 pool: x * inv_scale in float32, clamped to +-FP8_MAX
    FP8_MAX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
):
    # One program per (token, block of BLOCK_H heads of q, or of k and v). Neox rotation:
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves, in float32.
    token = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < HALF
    pos = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + dims, dmask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + dims, dmask, other=0.0)[None, :]
    if hb < num_q_programs:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (heads < num_q_heads)[:, None] & dmask[None, :]
        src = q_ptr + token * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :]
        x1 = tl.load(src, mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask, other=0.0).to(tl.float32)
        tl.store(src, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask)
        tl.store(src + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask)
    else:
        heads = (hb - num_q_programs) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < num_kv_heads
        mask = hmask[:, None] & dmask[None, :]
        slot = tl.load(slots_ptr + token)
        base = (
            kv_ptr + (slot // block_size) * stride_kv_block + (slot % block_size) * stride_kv_offset
        )
        base = base + heads[:, None] * stride_kv_head  # [BLOCK_H, 1]
        dst = base + dims[None, :]
        src = k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
        x1 = tl.load(src, mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask, other=0.0).to(tl.float32)
        # Rounded to k's dtype first: the values the unfused path stores (or quantizes).
        k1 = (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty)
        k2 = (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty)
        src = v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
        v1 = tl.load(src, mask, other=0.0)
        v2 = tl.load(src + HALF, mask, other=0.0)
        if QUANT:
            k1 = tl.minimum(tl.maximum(k1.to(tl.float32) * k_inv_scale, -FP8_MAX), FP8_MAX)
            k2 = tl.minimum(tl.maximum(k2.to(tl.float32) * k_inv_scale, -FP8_MAX), FP8_MAX)
            v1 = tl.minimum(tl.maximum(v1.to(tl.float32) * v_inv_scale, -FP8_MAX), FP8_MAX)
            v2 = tl.minimum(tl.maximum(v2.to(tl.float32) * v_inv_scale, -FP8_MAX), FP8_MAX)
        out_ty = kv_ptr.dtype.element_ty
        tl.store(dst, k1.to(out_ty), mask)
        tl.store(dst + HALF, k2.to(out_ty), mask)
        tl.store(dst + stride_kv_kv, v1.to(out_ty), mask)
        tl.store(dst + stride_kv_kv + HALF, v2.to(out_ty), mask)
        if PAD > 0:  # a pool padded to the attention kernel's head dim: zero columns
            cols = tl.arange(0, BLOCK_PAD)
            pmask = hmask[:, None] & (cols < PAD)[None, :]
            pad_dst = base + 2 * HALF + cols[None, :]
            zeros = tl.zeros((BLOCK_H, BLOCK_PAD), dtype=tl.float32).to(out_ty)
            tl.store(pad_dst, zeros, pmask)
            tl.store(pad_dst + stride_kv_kv, zeros, pmask)
