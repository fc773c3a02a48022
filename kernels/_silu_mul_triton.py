"""Triton kernel of `radixrt.kernels.silu_mul`; imported on first launch (see _triton.py)."""

import triton
import triton.language as tl


@triton.jit
def silu_mul_kernel(
    x_ptr,  # [T, 2 * I]: gate | up
    out_ptr,  # [T, I], written
    stride_x,
    stride_out,
    inter,
    BLOCK: tl.constexpr,
):
    # One program per (token, BLOCK columns): decode batches are a few rows of many columns.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask)
