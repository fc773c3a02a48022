"""Triton kernels of `radixrt.kernels.fp8_quant`; imported on first launch (see _triton.py).

Every kernel quantizes float rows to float8_e4m3fn in one pass over its input: q =
cast(clamp(y / scale, -448, 448)) with the division correctly rounded (`div_rn`, as torch
divides). SOFTWARE_ROUND rounds to the e4m3 grid in float32 arithmetic before the cast (the
values are then exact in fp8): Triton's interpreter casts float32 -> fp8 wrongly near binade
edges (7.91 -> 4.0), so CPU runs set it; GPUs convert in hardware (round to nearest even).
"""

import triton
import triton.language as tl

# the values of fp8_quant.FP8_MAX and MIN_SCALE, as constants the kernels can read
FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1.0 / (448.0 * 512.0))


@triton.jit
def _round_e4m3(y):
    """y (|y| <= 448, float32) rounded to nearest even on the e4m3 grid, in float32: adding
    and subtracting 1.5 * 2^(23 + e) rounds at the ulp 2^e (e = exponent - 3, >= -9)."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exponent, -6) - 3
    magic = (((127 + 23 + ulp_exp) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(y) + magic) - magic
    return tl.where(y < 0, -r, r)


@triton.jit
def _to_e4m3(y, scale, out_ty: tl.constexpr, SOFTWARE_ROUND: tl.constexpr):
    q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -FP8_MAX), FP8_MAX)
    if SOFTWARE_ROUND:
        q = _round_e4m3(q)
    return q.to(out_ty)


@triton.jit
def _scaled(x, row_scale_ptr, col_scale_ptrs, mask, ROW: tl.constexpr, COL: tl.constexpr):
    """x (a row of an unscaled GEMM output) * row scale * column scales in float32, rounded
    back to x's dtype (as a scaled GEMM stores its output); x itself without scales."""
    if ROW or COL:
        y = x.to(tl.float32)
        if ROW:
            y = y * tl.load(row_scale_ptr)
        if COL:
            y = y * tl.load(col_scale_ptrs, mask, other=0.0)
        return y.to(x.dtype)
    return x


@triton.jit
def _silu_mul(
    x_ptr,
    x_row_scale_ptr,
    x_col_scale_ptr,
    row,
    cols,
    mask,
    stride_x,
    inter,
    X_ROW_SCALE: tl.constexpr,
    X_COL_SCALE: tl.constexpr,
):
    """silu(gate) * up at columns `cols` of row `row` of x = [gate | up] (each scaled by x's
    row / column scales when given, `_scaled`), in float32, rounded to x's dtype (as
    FlashInfer's silu_and_mul writes it)."""
    gate = tl.load(x_ptr + row * stride_x + cols, mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask, other=0.0)
    row_scale = x_row_scale_ptr + row
    gate = _scaled(gate, row_scale, x_col_scale_ptr + cols, mask, X_ROW_SCALE, X_COL_SCALE)
    up = _scaled(up, row_scale, x_col_scale_ptr + inter + cols, mask, X_ROW_SCALE, X_COL_SCALE)
    gate, up = gate.to(tl.float32), up.to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)


@triton.jit
def scale_product_kernel(
    x_ptr,  # [T, N] unscaled GEMM output; scaled in place
    row_scale_ptr,  # [T] float32 (ROW)
    col_scale_ptr,  # [N] float32 (COL)
    bias_ptr,  # [N] (HAS_BIAS)
    stride_x,
    n,
    ROW: tl.constexpr,
    COL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (T, cdiv(N, BLOCK)): x = x * row scale * column scales (float32, rounded to x's
    dtype), then + bias (float32, rounded again: as a scaled GEMM's output plus a bias)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    ptrs = x_ptr + row * stride_x + cols
    x = tl.load(ptrs, mask, other=0.0)
    x = _scaled(x, row_scale_ptr + row, col_scale_ptr + cols, mask, ROW, COL)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) + bias).to(x_ptr.dtype.element_ty)
    tl.store(ptrs, x, mask)


@triton.jit
def quant_rows_kernel(
    x_ptr,  # [T, K] float (row stride stride_x)
    out_ptr,  # [T, K] fp8, written
    scale_ptr,  # PER_TOKEN: [T] float32, written; else [1] float32, read
    stride_x,
    stride_out,
    k,
    PER_TOKEN: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: per-token dynamic scale (absmax / 448) or a given per-tensor
    scale. Rows longer than BLOCK are read twice (absmax, then quantize)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    if PER_TOKEN:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, k, BLOCK):
            mask = start + cols < k
            x = tl.load(x_row + start + cols, mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
    else:
        scale = tl.load(scale_ptr)
    for start in range(0, k, BLOCK):
        mask = start + cols < k
        x = tl.load(x_row + start + cols, mask, other=0.0).to(tl.float32)
        q = _to_e4m3(x, scale, out_ptr.dtype.element_ty, SOFTWARE_ROUND)
        tl.store(out_row + start + cols, q, mask)


@triton.jit
def absmax_kernel(
    x_ptr,  # [T, K] float
    amax_ptr,  # [1] float32, zeroed by the caller; atomically maxed
    num_rows_ptr,  # [1] int: rows at or past it are left out (HAS_ROW_BOUND)
    stride_x,
    k,
    HAS_ROW_BOUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per-tensor dynamic scaling, pass 1: one program per row, max |x| into amax_ptr; with
    HAS_ROW_BOUND only rows below num_rows count (a CUDA graph's padding rows do not)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, k, BLOCK):
        mask = start + cols < k
        x = tl.load(x_ptr + row * stride_x + start + cols, mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    row_max = tl.max(amax, axis=0)
    if HAS_ROW_BOUND:
        row_max = tl.where(row < tl.load(num_rows_ptr), row_max, 0.0)
    tl.atomic_max(amax_ptr, row_max)


@triton.jit
def amax_to_scale_kernel(amax_ptr, scale_ptr):
    """Per-tensor dynamic scaling, between the passes: scale = max(amax / 448, MIN_SCALE)."""
    tl.store(scale_ptr, tl.maximum(tl.load(amax_ptr) / FP8_MAX, MIN_SCALE))


@triton.jit
def rmsnorm_quant_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H] or x_ptr when there is no residual (then never read)
    weight_ptr,  # [H]
    out_ptr,  # [T, H] fp8, written
    scale_ptr,  # PER_TOKEN: [T] float32, written; else [1] float32, read
    new_residual_ptr,  # [T, H], written when WRITE_RESIDUAL
    x_row_scale_ptr,  # [T] float32 (X_ROW_SCALE): x is an unscaled GEMM output
    x_col_scale_ptr,  # [H] float32 (X_COL_SCALE)
    stride_x,
    stride_residual,
    stride_out,
    stride_new_residual,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    WRITE_RESIDUAL: tl.constexpr,  # HAS_RESIDUAL or x scaled: new_residual is not x
    PER_TOKEN: tl.constexpr,
    X_ROW_SCALE: tl.constexpr,
    X_COL_SCALE: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row (BLOCK >= hidden): x scaled by its row / column scales when
    given (`_scaled`), the residual add and RMSNorm of `_rmsnorm_triton.rmsnorm_kernel`
    (same roundings: the norm output is rounded to x's dtype), then quantization of that
    output, without writing it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask, other=0.0)
    x = _scaled(x, x_row_scale_ptr + row, x_col_scale_ptr + cols, mask, X_ROW_SCALE, X_COL_SCALE)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if WRITE_RESIDUAL:
        tl.store(new_residual_ptr + row * stride_new_residual + cols, x, mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask, other=0.0).to(tl.float32)
    y = (xf * rstd * weight).to(x_ptr.dtype.element_ty).to(tl.float32)
    if PER_TOKEN:
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
    else:
        scale = tl.load(scale_ptr)
    q = _to_e4m3(y, scale, out_ptr.dtype.element_ty, SOFTWARE_ROUND)
    tl.store(out_ptr + row * stride_out + cols, q, mask)


@triton.jit
def silu_mul_quant_kernel(
    x_ptr,  # [T, 2I]: gate | up
    out_ptr,  # [T, I] fp8, written
    scale_ptr,  # PER_TOKEN: [T] float32, written; else [1] float32, read
    x_row_scale_ptr,  # [T] float32 (X_ROW_SCALE): x is an unscaled GEMM output
    x_col_scale_ptr,  # [2I] float32 (X_COL_SCALE)
    stride_x,
    stride_out,
    inter,
    PER_TOKEN: tl.constexpr,
    X_ROW_SCALE: tl.constexpr,
    X_COL_SCALE: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row (BLOCK >= I): gate and up scaled by x's row / column scales when
    given (`_scaled`), silu(gate) * up in float32, rounded to x's dtype (as FlashInfer's
    silu_and_mul writes it), then quantized."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter
    y = _silu_mul(
        x_ptr,
        x_row_scale_ptr,
        x_col_scale_ptr,
        row,
        cols,
        mask,
        stride_x,
        inter,
        X_ROW_SCALE,
        X_COL_SCALE,
    ).to(tl.float32)
    if PER_TOKEN:
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
    else:
        scale = tl.load(scale_ptr)
    q = _to_e4m3(y, scale, out_ptr.dtype.element_ty, SOFTWARE_ROUND)
    tl.store(out_ptr + row * stride_out + cols, q, mask)


@triton.jit
def silu_mul_chunk_kernel(
    x_ptr,  # [T, 2I]: gate | up
    y_ptr,  # [T, I] x's dtype, written: silu(gate) * up, rounded (PER_TOKEN)
    out_ptr,  # [T, I] fp8, written (not PER_TOKEN)
    partial_ptr,  # [T, S] float32, written: each chunk's max |y| (PER_TOKEN)
    scale_ptr,  # [1] float32, read (not PER_TOKEN)
    x_row_scale_ptr,  # [T] float32 (X_ROW_SCALE)
    x_col_scale_ptr,  # [2I] float32 (X_COL_SCALE)
    stride_x,
    stride_y,
    stride_out,
    inter,
    num_chunks,
    PER_TOKEN: tl.constexpr,
    X_ROW_SCALE: tl.constexpr,
    X_COL_SCALE: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (T, S): chunk c of row r of silu_mul_quant_kernel's y (same roundings). Per token,
    y and the chunk's max |y| are stored for quant_chunk_kernel (the row's scale needs every
    chunk); with a given scale the chunk is quantized here."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    y = _silu_mul(
        x_ptr,
        x_row_scale_ptr,
        x_col_scale_ptr,
        row,
        cols,
        mask,
        stride_x,
        inter,
        X_ROW_SCALE,
        X_COL_SCALE,
    )
    if PER_TOKEN:
        tl.store(y_ptr + row * stride_y + cols, y, mask)
        tl.store(partial_ptr + row * num_chunks + chunk, tl.max(tl.abs(y.to(tl.float32)), axis=0))
    else:
        q = _to_e4m3(y.to(tl.float32), tl.load(scale_ptr), out_ptr.dtype.element_ty, SOFTWARE_ROUND)
        tl.store(out_ptr + row * stride_out + cols, q, mask)


@triton.jit
def quant_chunk_kernel(
    y_ptr,  # [T, I] float
    out_ptr,  # [T, I] fp8, written
    partial_ptr,  # [T, S] float32: each chunk's max |y|
    scale_ptr,  # [T] float32, written (by chunk 0)
    stride_y,
    stride_out,
    inter,
    num_chunks,
    SOFTWARE_ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):
    """Grid (T, S): the row's per-token scale from its chunks' maxima, then chunk c cast."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    c = tl.arange(0, CHUNKS_BLOCK)
    amax = tl.max(tl.load(partial_ptr + row * num_chunks + c, c < num_chunks, other=0.0), axis=0)
    scale = tl.maximum(amax / FP8_MAX, MIN_SCALE)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    y = tl.load(y_ptr + row * stride_y + cols, mask, other=0.0).to(tl.float32)
    q = _to_e4m3(y, scale, out_ptr.dtype.element_ty, SOFTWARE_ROUND)
    tl.store(out_ptr + row * stride_out + cols, q, mask)
