"""FP8 activation quantization kernels (radixrt.kernels.fp8_quant) vs their torch references,
on CPU (TRITON_INTERPRET=1, set by conftest) and on CUDA.

Quantize-only kernels match the reference bit for bit. The fused ones round their 16-bit
intermediate (norm / silu output) to x's dtype; Triton's interpreter truncates that cast
(GPUs round to nearest), so in bf16 a quantized value may be one fp8 step off the
reference's; float32 inputs are exact."""

from __future__ import annotations

import os

import pytest
import torch

from radixrt.kernels import (
    HAS_TRITON,
    Fp8Product,
    dequantize_fp8,
    quantize_fp8,
    quantize_fp8_reference,
    rmsnorm_quantize_fp8,
    rmsnorm_quantize_fp8_reference,
    scale_product,
    scale_product_reference,
    silu_mul_quantize_fp8,
    silu_mul_quantize_fp8_reference,
)
from radixrt.kernels.fp8_quant import FP8_MAX, MIN_SCALE

STATIC = torch.tensor([0.03])


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 (set by conftest without CUDA)")
    return torch.device(request.param)


def _fp8_step(q: torch.Tensor) -> torch.Tensor:
    """The e4m3 spacing at each value of `q` (float32): 2^(exponent - 3), at least 2^-9."""
    e = torch.floor(torch.log2(q.abs().clamp(min=2**-6)))
    return torch.exp2(e - 3)


def _assert_quantized_close(got, want, exact: bool) -> None:
    assert got.data.dtype == torch.float8_e4m3fn and got.scale.dtype == torch.float32
    assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
    g, w = got.data.cpu().float(), want.data.cpu().float()
    torch.testing.assert_close(got.scale.cpu(), want.scale.cpu(), rtol=2**-6, atol=0)
    if exact:
        assert torch.equal(g, w)
    else:  # a rounding of the 16-bit intermediate apart: at most one fp8 step
        assert ((g - w).abs() <= _fp8_step(torch.maximum(g.abs(), w.abs())) * 1.01).all()
        assert (g != w).float().mean() < 0.1


def _scale(per_token: bool, static: bool, device) -> torch.Tensor | None:
    return STATIC.to(device) if static else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["token", "tensor-dynamic", "tensor-static"])
@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (5, 300), (3, 9000)])
def test_quantize_matches_reference(device, dtype, mode, shape):
    gen = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    x = torch.randn(shape, generator=gen)
    if shape[0] >= 5:  # rows of very different magnitudes, one all zero
        x = x * torch.tensor([0.01, 1.0, 300.0, 0.0, 3.0]).unsqueeze(1)
    x = x.to(dtype)
    per_token, static = mode == "token", mode == "tensor-static"
    want = quantize_fp8_reference(x, per_token=per_token, scale=_scale(per_token, static, "cpu"))
    got = quantize_fp8(x.to(device), per_token=per_token, scale=_scale(per_token, static, device))
    _assert_quantized_close(got, want, exact=True)
    if shape[0]:
        if per_token:
            amax = x.float().abs().amax(dim=1, keepdim=True)
            torch.testing.assert_close(want.scale, (amax / FP8_MAX).clamp(min=MIN_SCALE))
        # dequantized: within half an fp8 step of the input (where it is not clamped)
        if not static:
            back = dequantize_fp8(want, torch.float32)
            half_step = 0.5001 * _fp8_step(want.data.float()) * want.scale
            assert ((back - x.float()).abs() <= half_step + 1e-12).all()


def test_quantize_rounds_like_torch_at_binade_edges(device):
    """Values just below a power of two round up to it (the interpreter's own fp8 cast gets
    these wrong; the kernel rounds on the e4m3 grid itself there)."""
    x = torch.tensor([[7.91, 7.99, 31.6, -15.9, 447.0, 500.0, 2**-10, 0.0]])
    got = quantize_fp8(x.to(device), per_token=False, scale=torch.ones(1, device=device))
    want = quantize_fp8_reference(x, per_token=False, scale=torch.ones(1))
    assert torch.equal(got.data.cpu().float(), want.data.float())
    assert got.data.cpu().float()[0, :6].tolist() == [8.0, 8.0, 32.0, -16.0, 448.0, 448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_rmsnorm_quantize_matches_reference(device, dtype, with_residual, static):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(7, 192, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(192, generator=gen)).to(dtype)
    residual = torch.randn(7, 192, generator=gen).to(dtype) if with_residual else None
    scale = STATIC if static else None
    want, want_res = rmsnorm_quantize_fp8_reference(
        x, weight, 1e-6, residual, per_token=not static, scale=scale
    )
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    got, got_res = rmsnorm_quantize_fp8(
        dev(x), dev(weight), 1e-6, dev(residual), per_token=not static, scale=dev(scale)
    )
    exact = dtype == torch.float32 or device.type == "cuda"
    _assert_quantized_close(got, want, exact=exact and dtype == torch.float32)
    torch.testing.assert_close(got_res.cpu(), want_res, rtol=2**-7, atol=0)
    if with_residual:  # inputs untouched
        assert torch.equal(dev(residual).cpu(), residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_silu_mul_quantize_matches_reference(device, dtype, static):
    gen = torch.Generator().manual_seed(3)
    x = (2 * torch.randn(6, 2 * 512, generator=gen)).to(dtype)
    scale = STATIC if static else None
    want = silu_mul_quantize_fp8_reference(x, per_token=not static, scale=scale)
    got = silu_mul_quantize_fp8(
        x.to(device), per_token=not static, scale=None if scale is None else scale.to(device)
    )
    _assert_quantized_close(got, want, exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("scales", [None, "both"])
def test_silu_mul_quantize_split_rows_equal_whole_rows(device, dtype, static, scales):
    """Rows split into chunks (the decode-batch path; 600 columns: a partial last chunk) give
    the bytes and scales of one program per row."""
    x = (
        _product(5, 2 * 600, dtype, True, True, seed=8)
        if scales
        else (2 * torch.randn(5, 2 * 600, generator=torch.Generator().manual_seed(8))).to(dtype)
    )
    scale = None if not static else STATIC.to(device)
    copy = (lambda: _to(x, device)) if scales else (lambda: x.to(device))  # noqa: E731
    whole = silu_mul_quantize_fp8(copy(), per_token=not static, scale=scale)  # 600 < SILU_CHUNK
    for chunk in (128, 512):
        split = silu_mul_quantize_fp8(copy(), per_token=not static, scale=scale, chunk=chunk)
        assert torch.equal(split.data.view(torch.uint8), whole.data.view(torch.uint8)), chunk
        assert torch.equal(split.scale, whole.scale), chunk
    want = silu_mul_quantize_fp8_reference(
        x, per_token=not static, scale=STATIC if static else None
    )
    _assert_quantized_close(whole, want, exact=False)


def _product(t: int, n: int, dtype, row: bool, col: bool, seed: int) -> Fp8Product:
    """An unscaled GEMM output of large values (sums of e4m3 products) and its scales."""
    gen = torch.Generator().manual_seed(seed)
    raw = (3000 * torch.randn(t, n, generator=gen)).to(dtype)
    row_scale = torch.rand(t, 1, generator=gen) * 1e-3 + 1e-4 if row else None
    col_scale = torch.exp2(torch.randint(-12, -6, (n,), generator=gen).float()) if col else None
    return Fp8Product(raw, row_scale, col_scale)


def _to(p: Fp8Product, device) -> Fp8Product:
    """A copy of p on `device` (scale_product writes into its raw output)."""
    return Fp8Product(*(None if t is None else t.to(device, copy=True) for t in p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", ["row", "col", "both"])
@pytest.mark.parametrize("bias", [False, True])
def test_scale_product_matches_reference(device, dtype, scales, bias):
    p = _product(5, 1500, dtype, scales != "col", scales != "row", seed=1)
    b = torch.randn(1500).to(dtype) if bias else None
    want = scale_product_reference(p, b)
    got_p = _to(p, device)
    got = scale_product(got_p, None if b is None else b.to(device))
    assert got.data_ptr() == got_p.raw.data_ptr()  # in place
    if dtype == torch.float32 and device == "cpu":
        assert torch.equal(got.cpu(), want)
    elif dtype == torch.float32:  # GPUs contract x * s + bias into one FMA (one rounding less)
        size = scale_product_reference(p).abs() + (0 if b is None else b.abs())
        assert ((got.cpu() - want).abs() <= 2 * 2**-23 * size).all()
    else:  # the interpreter truncates float32 -> bf16 casts (GPUs round): an ulp per rounding
        size = scale_product_reference(p).float().abs() + (0 if b is None else b.float().abs())
        assert ((got.cpu().float() - want.float()).abs() <= 2 * 2**-7 * size).all()
    nothing = Fp8Product(p.raw.clone(), None, None)
    assert scale_product(nothing) is nothing.raw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", ["row", "col", "both"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_quantize_of_an_unscaled_product(device, dtype, scales, with_residual):
    """The scales are applied as x is read: bit for bit the kernel on x scaled first by
    `scale_product` (the residual stream gets the scaled x), and the reference's result."""
    p = _product(7, 192, dtype, scales != "col", scales != "row", seed=2)
    gen = torch.Generator().manual_seed(5)
    weight = (1 + 0.1 * torch.randn(192, generator=gen)).to(dtype)
    residual = torch.randn(7, 192, generator=gen).to(dtype) if with_residual else None
    want, want_res = rmsnorm_quantize_fp8_reference(p, weight, 1e-6, residual, per_token=True)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    args = (dev(weight), 1e-6, dev(residual))
    got, got_res = rmsnorm_quantize_fp8(_to(p, device), *args, per_token=True)
    first, first_res = rmsnorm_quantize_fp8(scale_product(_to(p, device)), *args, per_token=True)
    if device.type == "cuda" and dtype == torch.float32 and with_residual:
        # GPUs may contract x * s + residual into one FMA (the product's rounding skipped:
        # at most an ulp of x * s apart in the residual, which may cancel to far less than
        # x * s), at most one fp8 step in the output
        _assert_quantized_close(got, first, exact=False)
        ulp = 2**-23 * scale_product(_to(p, device)).abs().max().item()
        torch.testing.assert_close(got_res, first_res, rtol=2**-22, atol=ulp)
        _assert_quantized_close(got, want, exact=False)
        return
    assert torch.equal(got.data.float(), first.data.float()) and torch.equal(got.scale, first.scale)
    assert torch.equal(got_res, first_res)
    if dtype == torch.float32:
        _assert_quantized_close(got, want, exact=True)
        assert torch.equal(got_res.cpu(), want_res)
    elif device.type == "cuda":  # the interpreter's truncating casts compound here (CPU)
        _assert_quantized_close(got, want, exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", ["row", "col", "both"])
def test_silu_mul_quantize_of_an_unscaled_product(device, dtype, scales):
    p = _product(6, 2 * 512, dtype, scales != "col", scales != "row", seed=3)
    want = silu_mul_quantize_fp8_reference(p, per_token=True)
    got = silu_mul_quantize_fp8(_to(p, device), per_token=True)
    first = silu_mul_quantize_fp8(scale_product(_to(p, device)), per_token=True)
    assert torch.equal(got.data.float(), first.data.float()) and torch.equal(got.scale, first.scale)
    _assert_quantized_close(got, want, exact=False)


def test_dynamic_tensor_scale_counts_only_rows_below_num_rows(device):
    """A CUDA graph's padding rows (past num_rows) do not change the per-tensor scale."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 300, generator=gen)
    x[5:] *= 1000  # padding rows of much larger values
    num_rows = torch.tensor([5])
    want = quantize_fp8_reference(x[:5], per_token=False)
    got = quantize_fp8(x.to(device), per_token=False, num_rows=num_rows.to(device))
    ref = quantize_fp8_reference(x, per_token=False, num_rows=num_rows)
    assert torch.equal(got.scale.cpu(), want.scale) and torch.equal(ref.scale, want.scale)
    assert torch.equal(got.data[:5].cpu().float(), want.data.float())
    assert torch.equal(got.data.cpu().float(), ref.data.float())
    assert got.data[5:].cpu().float().abs().max() == FP8_MAX  # clamped


def test_bad_arguments():
    x = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="per-token quantization computes its scales"):
        quantize_fp8(x, per_token=True, scale=torch.ones(1))
    with pytest.raises(ValueError, match="one float32 number"):
        quantize_fp8(x, per_token=False, scale=torch.ones(2))
    with pytest.raises(ValueError, match="per-token or a given per-tensor scale"):
        silu_mul_quantize_fp8(x, per_token=False)
    with pytest.raises(ValueError, match=r"must be \[T, K\]"):
        quantize_fp8(torch.zeros(16), per_token=True)
