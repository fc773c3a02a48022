"""The native small-row GEMM (radixrt.kernels.gemm_cpu) against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from radixrt.kernels.gemm_cpu import PANEL, SmallGemm, load_gemm_small, pack_weight


@pytest.fixture(scope="module")
def gemm(native_kernel) -> SmallGemm:  # native_kernel: skips only without a C compiler
    got = load_gemm_small()
    assert got is not None, "a C compiler exists but gemm_small did not build"
    return got


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    scale = (want.abs().max().item() if want.numel() else 0.0) + 1e-30
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * scale)


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 32, 64, 128])
@pytest.mark.parametrize(("n", "k"), [(320, 192), (17, 5), (PANEL, 1), (1000, 67)])
def test_matches_reference(gemm: SmallGemm, rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 31 + n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    _check(gemm(x, pack_weight(w), n), x, w, None)


def test_bias_and_strided_rows(gemm: SmallGemm) -> None:
    w, b = torch.randn(40, 24), torch.randn(40)
    base = torch.randn(9, 30)
    x = base[:, 3:27]  # rows 30 floats apart
    _check(gemm(x, pack_weight(w), 40, b), x, w, b)


def test_rows_do_not_depend_on_the_batch(gemm: SmallGemm) -> None:
    """Each output is one FMA chain over k: a row's result is the same in any batch."""
    w = torch.randn(200, 96)
    x = torch.randn(37, 96)
    packed = pack_weight(w)
    full = gemm(x, packed, 200)
    for rows in (1, 4, 6, 11):
        assert torch.equal(gemm(x[:rows], packed, 200), full[:rows])
    assert torch.equal(gemm(x[5:6], packed, 200), full[5:6])


def test_threads_agree(gemm: SmallGemm) -> None:
    w, x = torch.randn(2048, 192), torch.randn(32, 192)  # above PARALLEL_MIN_MACS
    packed = pack_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm(x, packed, 2048)
        torch.set_num_threads(2)
        assert torch.equal(gemm(x, packed, 2048), one)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("defines", [("RADIXRT_PORTABLE",), ("RADIXRT_NO_OPENMP",)])
def test_other_builds(native_kernel, defines: tuple[str, ...]) -> None:
    from radixrt.kernels.native import load_library

    kernel = SmallGemm(load_library("gemm_small", defines))
    w, x = torch.randn(70, 33), torch.randn(11, 33)
    _check(kernel(x, pack_weight(w), 70), x, w, None)


def test_bad_arguments(gemm: SmallGemm) -> None:
    w = pack_weight(torch.randn(16, 8))
    with pytest.raises(ValueError, match="float32"):
        gemm(torch.randn(2, 8, dtype=torch.float64), w, 16)
    with pytest.raises(ValueError, match="packed"):
        gemm(torch.randn(2, 9), w, 16)
    with pytest.raises(ValueError, match="packed"):
        gemm(torch.randn(2, 8), w, 17)
    with pytest.raises(ValueError, match="bias"):
        gemm(torch.randn(2, 8), w, 16, torch.randn(15))
