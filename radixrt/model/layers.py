"""Model building blocks: RMSNorm, rotary embedding, SiLU-and-mul.

Each runs FlashInfer's fused CUDA kernel on CUDA half-precision tensors when flashinfer is
installed (RMSNorm with the residual add fused in, in place; RoPE from the cos/sin cache, in
place; SiLU-and-mul) and plain torch everywhere else (on a CPU: torch.rms_norm, one gathered
rotary table a forward; fused C versions of these ops gained under 10% of a whole run in
benchmarks/bench_cpu_paired.py and are not kept). Both paths share one contract; the fused one
rounds differently (float32 inside). On CUDA the model may run radixrt.kernels' Triton
versions instead (`radixrt.model.layer_ops`, chosen when it is built).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import nn

HALF_DTYPES = (torch.float16, torch.bfloat16)
ROPE_HEAD_DIMS = (64, 128, 256, 512)  # head dims FlashInfer's RoPE kernel takes


@functools.cache
def _flashinfer() -> ModuleType | None:
    """The flashinfer package, imported on first use, or None where it is not installed."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    import flashinfer
    import flashinfer.activation
    import flashinfer.norm
    import flashinfer.rope

    return flashinfer


def _fast(x: torch.Tensor) -> ModuleType | None:
    """flashinfer when `x` can take its kernels (CUDA, fp16/bf16), else None."""
    if x.is_cuda and x.dtype in HALF_DTYPES:
        return _flashinfer()
    return None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self._shape = (hidden_size,)  # the normalized shape, for torch.rms_norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (or [T, heads, H] without residual). With `residual` [T, H]: returns
        (norm(x + residual), x + residual). On the fused CUDA path (2-D x, weight of x's
        dtype) that pair is written into x and residual themselves (in place)."""
        weight = self.weight
        fused = x.dim() == 2 and weight.dtype == x.dtype
        if x.is_cuda:
            fi = _fast(x) if fused else None
            if fi is not None:
                if residual is None:
                    return fi.norm.rmsnorm(x, weight, self.eps)
                fi.norm.fused_add_rmsnorm(x, residual, weight, self.eps)
                return x, residual
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            # one fused op, bitwise equal to the formula below (tests/test_cpu_linear.py);
            # the aten op itself: F.rms_norm's wrapper costs ~3 us a call at decode sizes
            out = torch.rms_norm(x, self._shape, weight, self.eps)
            return out if residual is None else (out, residual)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = weight * xf.to(dtype)
        return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] (gate | up) -> silu(gate) * up [T, I]."""
    fi = _fast(x)
    if fi is not None and x.is_contiguous() and x.shape[-1] * x.element_size() % 16 == 0:
        return fi.activation.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [T, I], written into gate (which is returned)."""
    return nn.functional.silu(gate, inplace=True).mul_(up)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] float32, with llama3 / linear scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")


class RopeInputs(NamedTuple):
    """One forward's rotary inputs, made once for all layers (`RotaryEmbedding.prepare`)."""

    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor | None  # [T, 1, d] (cos | cos) in the model's dtype; None on the fused
    # CUDA path
    sin: torch.Tensor | None  # [T, 1, d] (-sin | sin)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF Llama/Qwen `rotate_half`) indexed by positions."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        # [max_positions, head_dim]: cos | sin halves, float32 (FlashInfer's RoPE cache)
        self.register_buffer("cos_sin", torch.cat([cos, sin], dim=-1), False)
        # [max_positions, 2 * head_dim]: (cos | cos | -sin | sin), float32, what the torch path
        # reads (one gather a forward: 32 tokens 150 -> 57 us with cold caches, 4096 tokens
        # 0.46 -> 0.21 ms); not made where the fused CUDA path will run (a half-precision
        # model built on CUDA with flashinfer installed and a head dim its kernel takes)
        table = None
        if not _fused_rope(cos.device, torch.get_default_dtype(), head_dim):
            table = torch.cat([cos, cos, -sin, sin], dim=-1)
        self.register_buffer("rope_table", table, False)

    def prepare(self, positions: torch.Tensor, x: torch.Tensor) -> RopeInputs:
        """The rotary inputs of `positions` [T] for activations like `x` (device, dtype):
        cos/sin gathered here once, not in every layer (none on the fused CUDA path)."""
        if _fast(x) is not None and self.head_dim in ROPE_HEAD_DIMS:
            return RopeInputs(positions, None, None)
        d, table = self.head_dim, self.rope_table
        if table is not None:
            full = table.index_select(0, positions).to(x.dtype).unsqueeze(1)  # [T, 1, 2d]
        else:  # a model moved off the device it was built for
            cos, sin = self.cos_sin[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
            full = torch.cat([cos, cos, -sin, sin], dim=-1)
        return RopeInputs(positions, full[..., :d], full[..., d:])

    def forward(
        self, rope: RopeInputs, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, hq, d], k [T, hkv, d] -> rotated (same shapes/dtypes). On the fused CUDA
        path (`rope.cos` is None) q and k are rotated in place (any token/head strides) and
        returned; otherwise new tensors: when k's heads follow q's in one
        buffer (views of a merged qkv output) both are rotated at once and returned as the two
        parts of one [T, hq + hkv, d] tensor (heads and last dim contiguous, tokens hq + hkv
        heads apart), else each contiguous."""
        if rope.cos is None:
            fi = _flashinfer()
            assert fi is not None
            fi.rope.apply_rope_with_cos_sin_cache_inplace(
                rope.positions, q, k, self.head_dim, self.cos_sin, is_neox=True
            )
            return q, k
        qk = _joint(q, k)
        if qk is not None:
            out = _rotate(qk, rope.cos, rope.sin)
            return out[:, : q.shape[1]], out[:, q.shape[1] :]
        return _rotate(q, rope.cos, rope.sin), _rotate(k, rope.cos, rope.sin)


def _fused_rope(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `RotaryEmbedding.prepare` takes FlashInfer's path for activations of this
    device and dtype (what `_fast` and ROPE_HEAD_DIMS decide at run time)."""
    return (
        device.type == "cuda"
        and dtype in HALF_DTYPES
        and head_dim in ROPE_HEAD_DIMS
        and _flashinfer() is not None
    )


def _joint(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, hq + hkv, d] view when k's heads follow q's in memory (a merged
    qkv output), else None."""
    t, hq, d = q.shape
    if (
        q.stride() != k.stride()
        or q.stride()[1:] != (d, 1)
        or q.dtype != k.dtype
        or k.data_ptr() != q.data_ptr() + hq * d * q.element_size()
    ):
        return None
    return q.as_strided((t, hq + k.shape[1], d), q.stride())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, h, d] -> x * [cos, cos] + rotate_half(x) * [sin, sin] (HF's formula, the same
    roundings: each half is x1 * cos - x2 * sin or x2 * cos + x1 * sin; here as
    x * (cos | cos) + (x2 | x1) * (-sin | sin), negation being exact), in four ops over
    whole heads. `cos`, `sin`: [T, 1, d] as `RotaryEmbedding.prepare` makes them.
    (x2 | x1) is a roll by d / 2 (any strides), cheaper than a flip of the halves on CPU
    (alone at 32 tokens x 8 heads x 32: 9.4 -> 4.4 us, 4096 tokens 0.86 -> 0.33 ms; this
    whole function at 32 tokens 16 -> 11 us, at 4096 within this machine's noise)."""
    out = torch.mul(x, cos)
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # (x2 | x1), a new tensor
    return out.add_(swapped.mul_(sin))
