"""Fused elementwise ops for a CPU float32 forward (native kernel, csrc/cpu_ops.c).

`load_cpu_ops()` is the loaded library's ops, or None where it cannot be built (no compiler,
RADIXRT_NATIVE_KERNELS=0; see radixrt.kernels.native): callers then keep their torch formulas.
Inputs are float32 CPU tensors; the wrappers check what the C code relies on (dtypes, a
contiguous last dimension) and raise ValueError otherwise. They run on torch's thread count
when a call has enough rows to pay for a parallel region.

- `rmsnorm(x, weight, eps)` / `add_rmsnorm_(x, residual, weight, eps)`: RMSNorm, the second
  in place (residual += x; x = norm(residual)) as FlashInfer's fused_add_rmsnorm; the sum of
  squares in double (last-bit differences from torch.rms_norm in a few outputs).
- `rope_(heads, num_rotated, positions, table)`: neox rotary of the first heads of each token,
  in place, with RotaryEmbedding.rope_table's (cos | cos | -sin | sin) rows; bitwise the torch
  formula.
- `silu_mul(gate, up, out=None)`: silu(gate) * up in one pass (relative ~3e-7 from torch's).
- `store_kv(k, v, slots, k_pool, v_pool)`: the rows of k and v [T, kv_heads, d] written at
  `slots` of the flat pools [num_slots, kv_heads, d] (two index_copy_ in one call).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from radixrt.kernels.native import check_status, load_library

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
PARALLEL_MIN_ELEMENTS = 1 << 16  # floats from which a call splits rows over torch's threads


def _f32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be a float32 CPU tensor with a contiguous last dim, got {t.dtype} "
            f"on {t.device} with strides {t.stride()}"
        )


class CpuOps:
    """The loaded csrc/cpu_ops.c; see the module docstring. The wrappers check only what the
    C code would misread (dtype, strides, shapes): the hot path of a decode step calls them
    ~10 times a layer."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = lib.radixrt_add_rmsnorm_f32
        self._norm.argtypes = [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _F32, _I32]
        self._rope = lib.radixrt_rope_neox_f32
        self._rope.argtypes = [_P, _I64, _P, _P, _I64, _I64, _I32, _I32, _I32]
        self._store = lib.radixrt_store_kv_f32
        self._store.argtypes = [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64]
        self._silu = lib.radixrt_silu_mul_f32
        self._silu.argtypes = [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I32]
        for fn in (self._norm, self._rope, self._store, self._silu):
            fn.restype = ctypes.c_int

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * normalize(x) for x [T, H] (rows may be strided): a new contiguous tensor."""
        n, h = x.shape
        _rows("x", x, h)
        _weight(weight, h)
        out = torch.empty((n, h), dtype=torch.float32)
        rc = self._norm(
            x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), h, n, h,
            eps, _threads(n * h),
        )  # fmt: skip
        check_status(rc, "native rmsnorm")
        return out

    def add_rmsnorm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """In place: residual += x, then x = weight * normalize(residual). x, residual
        [T, H] (rows may be strided), distinct memory."""
        n, h = x.shape
        _rows("x", x, h)
        _rows("residual", residual, h)
        _weight(weight, h)
        if residual.shape[0] != n:
            raise ValueError(f"residual has {residual.shape[0]} rows, x {n}")
        rc = self._norm(
            x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
            x.data_ptr(), x.stride(0), n, h, eps, _threads(n * h),
        )  # fmt: skip
        check_status(rc, "native add_rmsnorm_")

    def rope_(
        self,
        heads: torch.Tensor,  # [T, H, d] float32: heads and d contiguous, rows strided
        num_rotated: int,  # the first num_rotated heads of each token are rotated
        positions: torch.Tensor,  # [T] int64 contiguous
        table: torch.Tensor,  # [max_positions, 2 * d] float32 contiguous
    ) -> None:
        """Rotates heads[:, :num_rotated] in place (RuntimeError, nothing written, if a position
        is outside the table)."""
        n, num_heads, d = heads.shape
        _rows("heads", heads, num_heads * d, heads.stride(1) == d)
        if not 0 < num_rotated <= num_heads:
            raise ValueError(f"num_rotated must be in [1, {num_heads}], got {num_rotated}")
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            raise ValueError("positions must be a contiguous int64 tensor")
        if positions.shape[0] != n or not table.is_contiguous() or table.shape[1] != 2 * d:
            raise ValueError(f"positions [{n}] and a contiguous table [max_positions, {2 * d}]")
        rc = self._rope(
            heads.data_ptr(), heads.stride(0), positions.data_ptr(), table.data_ptr(),
            table.shape[0], n, num_rotated, d, _threads(n * num_rotated * d),
        )  # fmt: skip
        check_status(rc, "native rope_")

    def store_kv(
        self,
        k: torch.Tensor,  # [T, kv_heads, d]; heads and d contiguous, rows strided
        v: torch.Tensor,
        slots: torch.Tensor,  # [T] int64 contiguous
        k_pool: torch.Tensor,  # [num_slots, kv_heads, d] contiguous
        v_pool: torch.Tensor,
    ) -> None:
        """k_pool[slots] = k, v_pool[slots] = v (RuntimeError, nothing written, if a slot is
        out of range)."""
        n, hkv, d = k.shape
        row = hkv * d
        _rows("k", k, row, k.stride(1) == d)
        _rows("v", v, row, v.stride(1) == d and v.shape == k.shape)
        for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
            _rows(name, pool, row, pool.is_contiguous() and pool.shape[1:] == k.shape[1:])
        if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape[0] != n:
            raise ValueError(f"slots must be a contiguous int64 [{n}]")
        rc = self._store(
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(),
            k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[0], n, row,
        )  # fmt: skip
        check_status(rc, "native store_kv")

    def silu_mul(
        self, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """silu(gate) * up for gate, up [T, I] (rows may be strided: e.g. the halves of one
        gate_up output); into `out` ([T, I] rows, may be `gate` itself) or a new tensor."""
        n, inter = gate.shape
        _rows("gate", gate, inter)
        _rows("up", up, inter, up.shape == gate.shape)
        if out is None:
            out = torch.empty((n, inter), dtype=torch.float32)
        else:
            _rows("out", out, inter, out.shape == gate.shape)
        rc = self._silu(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
            out.stride(0), n, inter, _threads(n * inter),
        )  # fmt: skip
        check_status(rc, "native silu_mul")
        return out


def _rows(name: str, t: torch.Tensor, row: int, ok: bool = True) -> None:
    """t: float32 CPU rows of `row` contiguous floats (plus `ok`, the caller's own check)."""
    if not (ok and t.dtype == torch.float32 and t.is_cpu and t.stride(-1) == 1):
        raise ValueError(
            f"{name} must be float32 CPU rows of {row} contiguous values, got {t.dtype} "
            f"{tuple(t.shape)} on {t.device} with strides {t.stride()}"
        )


def _weight(weight: torch.Tensor, h: int) -> None:
    if weight.dtype != torch.float32 or not weight.is_contiguous() or weight.shape[0] != h:
        raise ValueError(f"weight must be a contiguous float32 [{h}], got {tuple(weight.shape)}")


def _threads(elements: int) -> int:
    return torch.get_num_threads() if elements >= PARALLEL_MIN_ELEMENTS else 1


@functools.cache
def load_cpu_ops() -> CpuOps | None:
    """The ops, built on first use; None if they cannot be (see radixrt.kernels.native)."""
    lib = load_library("cpu_ops")
    return None if lib is None else CpuOps(lib)
