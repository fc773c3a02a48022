"""Triton kernel of `radixrt.kernels.rmsnorm`; imported on first launch (see _triton.py)."""

import triton
import triton.language as tl


@triton.jit
def rmsnorm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H] or x_ptr when there is no residual (then never read)
    weight_ptr,  # [H]
    out_ptr,  # [T, H], written
    new_residual_ptr,  # [T, H], written when HAS_RESIDUAL
    stride_x,
    stride_residual,
    stride_out,
    stride_new_residual,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per token row; the whole row is one block (BLOCK >= hidden).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, x, mask)
    # Normalise the residual as stored (rounded to x's dtype), as the unfused model does.
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, (x * rstd * weight).to(out_ptr.dtype.element_ty), mask
    )
