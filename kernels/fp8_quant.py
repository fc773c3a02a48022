"""Activation quantization to float8_e4m3fn for FP8 GEMMs, each kernel one pass over its input.

A quantized activation is `Fp8Activation(data, scale)` with x ~ data.float() * scale:
- per token (dynamic): scale [T, 1] float32, max |row| / 448 per row (at least MIN_SCALE);
  what `torch._scaled_mm`'s row-wise mode takes as scale_a;
- per tensor: scale [1] float32, either given (a checkpoint's static input scale) or dynamic
  (max |x| / 448 over the whole tensor: two kernels, an atomic max then the cast).

Fused variants quantize the output of RMSNorm (with the residual add) and of SiLU-and-mul
without writing it in 16 bits first. Fused kernels take per-token or a given per-tensor
scale; dynamic per-tensor scaling needs the whole output before any row is cast. Their input
may be an `Fp8Product`: a GEMM output still to be multiplied by per-row and per-column scales
(the epilogue of `radixrt.model.fp8_linear`'s tensor-wise GEMM), which they apply as they read
it; `scale_product` applies them alone (and a bias).

Roundings (the references do the same): q = fp8(clamp(y / scale, -448, 448)), the division
correctly rounded and the cast to nearest even; the fused kernels round their 16-bit output
(y) to x's dtype before quantizing it, as the unfused ops would have stored it.
All functions allocate their outputs and never mutate their inputs; T = 0 launches nothing.
"""

from typing import NamedTuple

import torch

from ._triton import cdiv, load_triton_module, next_power_of_2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_SCALE = 1.0 / (448.0 * 512.0)  # a dynamic scale is at least this (all-zero rows)
MAX_ROW_BLOCK = 4096  # quantize-only kernels read longer rows in blocks of this many
# SiLU-and-mul + quantization of at most this many rows splits each row into chunks of
# SILU_CHUNK columns, one program each (per token: two kernels, the second casting once the
# row's maximum is known); one program per long row (Llama-3-8B: 14,336 columns) leaves all
# but a few SMs idle at decode batch sizes.
SILU_SPLIT_MAX_ROWS = 256
SILU_CHUNK = 2048


class Fp8Activation(NamedTuple):
    data: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] float32 (per token) or [1] float32 (per tensor)


class Fp8Product(NamedTuple):
    """A GEMM output whose scales are still to apply: value = raw.float() * row_scale *
    col_scale, rounded to raw's dtype (what a row-wise scaled GEMM would have output)."""

    raw: torch.Tensor  # [T, N] bfloat16 or float32 (contiguous rows)
    row_scale: torch.Tensor | None  # [T, 1] float32 (per-token activation scales), or None
    col_scale: torch.Tensor | None  # [N] float32 (per-channel weight scales), or None


def _software_round(x: torch.Tensor) -> bool:
    """CPU tensors run under Triton's interpreter, whose fp8 cast is wrong near binade edges:
    the kernels then round on the e4m3 grid themselves (see _fp8_quant_triton)."""
    return not x.is_cuda


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [T, K], got {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(f"{name} must be float32/bfloat16/float16, got {x.dtype}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _static_scale(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != x.device:
        raise ValueError(
            f"a per-tensor scale must be one float32 number on {x.device}, got "
            f"{tuple(scale.shape)} {scale.dtype} on {scale.device}"
        )
    return scale.reshape(1)


def quantize_fp8(
    x: torch.Tensor,
    *,
    per_token: bool,
    scale: torch.Tensor | None = None,
    num_rows: torch.Tensor | None = None,
) -> Fp8Activation:
    """x [T, K] float -> Fp8Activation. per_token: dynamic per-row scales (`scale` must be
    None); else per tensor: `scale` (one float32) when given, else dynamic: the absmax of
    rows [0, num_rows) when `num_rows` ([1] integer, on x's device: a CUDA graph's real rows)
    is given, else of all rows; rows past it are cast with that scale (clamped)."""
    x = _rows(x, "x")
    t, k = x.shape
    out = torch.empty((t, k), dtype=FP8_DTYPE, device=x.device)
    mod = load_triton_module("_fp8_quant_triton")
    block = min(next_power_of_2(k), MAX_ROW_BLOCK)
    warps = min(max(block // 512, 1), 8)
    if per_token:
        if scale is not None:
            raise ValueError("per-token quantization computes its scales; got a scale")
        scales = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    elif scale is not None:
        scales = _static_scale(scale, x)
    else:  # dynamic per tensor: absmax of all rows first
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        scales = torch.empty(1, dtype=torch.float32, device=x.device)
        if t:
            mod.absmax_kernel[(t,)](
                x,
                amax,
                amax if num_rows is None else num_rows,
                x.stride(0),
                k,
                HAS_ROW_BOUND=num_rows is not None,
                BLOCK=block,
                num_warps=warps,
            )
        mod.amax_to_scale_kernel[(1,)](amax, scales)
    if t:
        mod.quant_rows_kernel[(t,)](
            x,
            out,
            scales,
            x.stride(0),
            out.stride(0),
            k,
            PER_TOKEN=per_token,
            SOFTWARE_ROUND=_software_round(x),
            BLOCK=block,
            num_warps=warps,
        )
    return Fp8Activation(out, scales)


def rmsnorm_quantize_fp8(
    x: torch.Tensor | Fp8Product,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    *,
    per_token: bool,
    scale: torch.Tensor | None = None,
) -> tuple[Fp8Activation, torch.Tensor]:
    """(quantize(rmsnorm(x + residual) * weight), x + residual): `radixrt.kernels.rmsnorm`
    fused with `quantize_fp8` (per token, or the given per-tensor `scale`); x may be an
    `Fp8Product`, scaled as it is read. The new residual is a new tensor (x itself without a
    residual and without scales)."""
    x, row_scale, col_scale = _product(x)
    t, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x ({tuple(x.shape)} {x.dtype})")
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    scales = _scales(x, t, per_token, scale)
    out = torch.empty((t, hidden), dtype=FP8_DTYPE, device=x.device)
    scaled = row_scale is not None or col_scale is not None
    new_residual = x if residual is None and not scaled else torch.empty_like(x)
    if t:
        block = next_power_of_2(hidden)
        load_triton_module("_fp8_quant_triton").rmsnorm_quant_kernel[(t,)](
            x,
            x if residual is None else residual,
            weight.contiguous(),
            out,
            scales,
            new_residual,
            scales if row_scale is None else row_scale,
            scales if col_scale is None else col_scale,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            out.stride(0),
            new_residual.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            WRITE_RESIDUAL=residual is not None or scaled,
            PER_TOKEN=per_token,
            X_ROW_SCALE=row_scale is not None,
            X_COL_SCALE=col_scale is not None,
            SOFTWARE_ROUND=_software_round(x),
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    return Fp8Activation(out, scales), new_residual


def silu_mul_quantize_fp8(
    x: torch.Tensor | Fp8Product,
    *,
    per_token: bool,
    scale: torch.Tensor | None = None,
    chunk: int | None = None,
) -> Fp8Activation:
    """x [T, 2I] (gate | up) -> quantize(silu(gate) * up) [T, I] (per token, or the given
    per-tensor `scale`); x may be an `Fp8Product`, scaled as it is read. Up to
    SILU_SPLIT_MAX_ROWS rows are split into chunks of `chunk` columns (a power of two;
    None: SILU_CHUNK), with the same result."""
    x, row_scale, col_scale = _product(x)
    t, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x must be [T, 2I], got {tuple(x.shape)}")
    inter = two_i // 2
    scales = _scales(x, t, per_token, scale)
    out = torch.empty((t, inter), dtype=FP8_DTYPE, device=x.device)
    chunk = chunk or SILU_CHUNK
    if t and t <= SILU_SPLIT_MAX_ROWS and inter > chunk:
        _silu_mul_quantize_chunks(x, row_scale, col_scale, out, scales, per_token, chunk)
    elif t:
        block = next_power_of_2(inter)
        load_triton_module("_fp8_quant_triton").silu_mul_quant_kernel[(t,)](
            x,
            out,
            scales,
            scales if row_scale is None else row_scale,
            scales if col_scale is None else col_scale,
            x.stride(0),
            out.stride(0),
            inter,
            PER_TOKEN=per_token,
            X_ROW_SCALE=row_scale is not None,
            X_COL_SCALE=col_scale is not None,
            SOFTWARE_ROUND=_software_round(x),
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    return Fp8Activation(out, scales)


def _silu_mul_quantize_chunks(
    x: torch.Tensor,
    row_scale: torch.Tensor | None,
    col_scale: torch.Tensor | None,
    out: torch.Tensor,
    scales: torch.Tensor,
    per_token: bool,
    chunk: int,
) -> None:
    """`silu_mul_quantize_fp8`'s split path: grid (T, chunks)."""
    if chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    t, inter = out.shape
    num_chunks = cdiv(inter, chunk)
    mod = load_triton_module("_fp8_quant_triton")
    # per token: y and each chunk's max |y| for the second kernel; else neither is written
    y, partial = out, scales
    if per_token:
        y = torch.empty((t, inter), dtype=x.dtype, device=x.device)
        partial = torch.empty((t, num_chunks), dtype=torch.float32, device=x.device)
    warps = min(max(chunk // 256, 1), 8)
    mod.silu_mul_chunk_kernel[(t, num_chunks)](
        x,
        y,
        out,
        partial,
        scales,
        scales if row_scale is None else row_scale,
        scales if col_scale is None else col_scale,
        x.stride(0),
        y.stride(0),
        out.stride(0),
        inter,
        num_chunks,
        PER_TOKEN=per_token,
        X_ROW_SCALE=row_scale is not None,
        X_COL_SCALE=col_scale is not None,
        SOFTWARE_ROUND=_software_round(x),
        BLOCK=chunk,
        num_warps=warps,
    )
    if per_token:
        mod.quant_chunk_kernel[(t, num_chunks)](
            y,
            out,
            partial,
            scales,
            y.stride(0),
            out.stride(0),
            inter,
            num_chunks,
            SOFTWARE_ROUND=_software_round(x),
            BLOCK=chunk,
            CHUNKS_BLOCK=next_power_of_2(num_chunks),
            num_warps=warps,
        )


def scale_product(p: Fp8Product, bias: torch.Tensor | None = None) -> torch.Tensor:
    """p's value (+ bias [N], rounded once more, as a GEMM output plus a bias), written into
    p.raw, which is returned: one kernel, none when there is nothing to apply."""
    x = p.raw
    if p.row_scale is None and p.col_scale is None and bias is None:
        return x
    assert x.dim() == 2 and x.stride(-1) == 1, "an Fp8Product's raw output is [T, N] row-major"
    t, n = x.shape
    if t:
        block = min(next_power_of_2(n), 1024)
        load_triton_module("_fp8_quant_triton").scale_product_kernel[(t, cdiv(n, block))](
            x,
            x if p.row_scale is None else p.row_scale,
            x if p.col_scale is None else p.col_scale,
            x if bias is None else bias,
            x.stride(0),
            n,
            ROW=p.row_scale is not None,
            COL=p.col_scale is not None,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=4,
        )
    return x


def _product(
    x: torch.Tensor | Fp8Product,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(rows of x, its row scales or None, its column scales or None) of an input that may
    be an Fp8Product."""
    if isinstance(x, Fp8Product):
        raw = _rows(x.raw, "x.raw")
        t, n = raw.shape
        if x.row_scale is not None:
            assert x.row_scale.shape == (t, 1) and x.row_scale.dtype == torch.float32
        if x.col_scale is not None:
            assert x.col_scale.shape == (n,) and x.col_scale.dtype == torch.float32
        return raw, x.row_scale, x.col_scale
    return _rows(x, "x"), None, None


def _scales(x: torch.Tensor, t: int, per_token: bool, scale: torch.Tensor | None) -> torch.Tensor:
    """The scale buffer of a fused kernel: [T, 1] to fill (per token) or the given one."""
    if per_token:
        if scale is not None:
            raise ValueError("per-token quantization computes its scales; got a scale")
        return torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if scale is None:
        raise ValueError("fused kernels take per-token or a given per-tensor scale")
    return _static_scale(scale, x)


# ---------------------------------------------------------------- references (torch)


def cast_fp8_reference(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(clamp(y / scale, -448, 448)), y float32, `scale` broadcastable to y."""
    return (y / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _reference_quantize(
    y: torch.Tensor, per_token: bool, scale: torch.Tensor | None
) -> Fp8Activation:
    y = y.float()
    if per_token:
        scale = (y.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    elif scale is None:
        amax = y.abs().amax() if y.numel() else y.new_zeros(())
        scale = (amax / FP8_MAX).clamp(min=MIN_SCALE).reshape(1)
    else:
        scale = scale.float().reshape(1)
    return Fp8Activation(cast_fp8_reference(y, scale), scale)


def quantize_fp8_reference(
    x: torch.Tensor,
    *,
    per_token: bool,
    scale: torch.Tensor | None = None,
    num_rows: torch.Tensor | None = None,
) -> Fp8Activation:
    """Torch version of `quantize_fp8` (same contract and rounding)."""
    x = _rows(x, "x")
    if not per_token and scale is None and num_rows is not None:
        real = x[: int(num_rows.reshape(()).item())].float()
        amax = real.abs().amax() if real.numel() else real.new_zeros(())
        scale = (amax / FP8_MAX).clamp(min=MIN_SCALE).reshape(1)
    return _reference_quantize(x, per_token, scale)


def scale_product_reference(p: Fp8Product, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch version of `scale_product` (a new tensor; p is not modified)."""
    y = p.raw.float()
    if p.row_scale is not None:
        y = y * p.row_scale
    if p.col_scale is not None:
        y = y * p.col_scale
    y = y.to(p.raw.dtype)
    return y if bias is None else (y.float() + bias.float()).to(p.raw.dtype)


def _value(x: torch.Tensor | Fp8Product) -> torch.Tensor:
    return scale_product_reference(x) if isinstance(x, Fp8Product) else x


def rmsnorm_quantize_fp8_reference(
    x: torch.Tensor | Fp8Product,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    *,
    per_token: bool,
    scale: torch.Tensor | None = None,
) -> tuple[Fp8Activation, torch.Tensor]:
    """Torch version of `rmsnorm_quantize_fp8`: `rmsnorm_reference`, then quantization."""
    from .rmsnorm import rmsnorm_reference

    normed = rmsnorm_reference(_value(x), weight, eps, residual)
    return _reference_quantize(normed.out, per_token, scale), normed.new_residual


def silu_mul_quantize_fp8_reference(
    x: torch.Tensor | Fp8Product, *, per_token: bool, scale: torch.Tensor | None = None
) -> Fp8Activation:
    """Torch version of `silu_mul_quantize_fp8`."""
    x = _value(x)
    gate, up = x.float().chunk(2, dim=-1)
    y = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    return _reference_quantize(y, per_token, scale)


def dequantize_fp8(q: Fp8Activation, dtype: torch.dtype) -> torch.Tensor:
    """q.data * q.scale in `dtype` ([T, K])."""
    return (q.data.float() * q.scale).to(dtype)
