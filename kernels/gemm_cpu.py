"""A native float32 GEMM for few rows (decode steps) over a prepacked weight (csrc/gemm_small.c).

`load_gemm_small()` is the kernel or None where it cannot be built (radixrt.kernels.native):
callers keep their torch / oneDNN path. `pack_weight(w)` makes the layout it reads (panels of
16 output features, [ceil(N / 16), K, 16], zero-padded); `gemm(x, packed, n, bias)` computes
x @ w.T (+ bias). Results differ from MKL's and oneDNN's in the last bits (another summation
order); each output is one FMA chain over k, the same whatever the number of rows.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from radixrt.kernels.native import check_status, load_library

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
PANEL = 16  # output features per panel (NR in the C source)
PARALLEL_MIN_MACS = 1 << 21  # multiply-adds from which a call splits panels over threads


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] float32 -> [ceil(N / 16), K, 16] contiguous (a new tensor)."""
    n, k = w.shape
    panels = -(-n // PANEL)
    padded = w.new_zeros((panels * PANEL, k))
    padded[:n] = w
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


class SmallGemm:
    """The loaded kernel; see the module docstring."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.radixrt_gemm_small_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32]
        self._fn = fn

    def __call__(
        self,
        x: torch.Tensor,  # [M, K] float32 CPU, K contiguous (rows may be strided)
        packed: torch.Tensor,  # pack_weight(w) of a w [n, K]
        n: int,
        bias: torch.Tensor | None = None,  # [n] float32 contiguous
    ) -> torch.Tensor:
        """x @ w.T (+ bias): a new [M, n] float32 tensor."""
        m, k = x.shape
        if x.dtype != torch.float32 or not x.is_cpu or x.stride(1) != 1:
            raise ValueError(f"x must be float32 CPU rows, got {x.dtype} strides {x.stride()}")
        if packed.shape[1] != k or packed.shape[0] * PANEL < n or not packed.is_contiguous():
            raise ValueError(f"packed {tuple(packed.shape)} is not a packed [{n}, {k}] weight")
        if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"bias must be a contiguous [{n}]")
        out = torch.empty((m, n), dtype=torch.float32)
        if m == 0:
            return out
        threads = torch.get_num_threads() if m * n * k >= PARALLEL_MIN_MACS else 1
        rc = self._fn(
            x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), n,
            None if bias is None else bias.data_ptr(), out.data_ptr(), n, threads,
        )  # fmt: skip
        check_status(rc, "native gemm_small")
        return out


@functools.cache
def load_gemm_small() -> SmallGemm | None:
    """The kernel, built on first use; None if it cannot be (see radixrt.kernels.native)."""
    lib = load_library("gemm_small")
    return None if lib is None else SmallGemm(lib)
