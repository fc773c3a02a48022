"""Fused residual add + RMSNorm, the per-layer norm of Llama-style models."""

from typing import NamedTuple

import torch

from ._triton import load_triton_module, next_power_of_2


class RMSNormResult(NamedTuple):
    out: torch.Tensor  # [T, H] x.dtype: rmsnorm(new_residual) * weight
    new_residual: torch.Tensor  # [T, H] x.dtype: x + residual (x itself when residual is None)


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    if weight.shape != x.shape[1:]:
        raise ValueError(f"weight must be [H] = [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)} {x.dtype}), "
            f"got {tuple(residual.shape)} {residual.dtype}"
        )
    devices = {x.device, weight.device} | ({residual.device} if residual is not None else set())
    if len(devices) != 1:
        raise ValueError(f"x, weight and residual must share one device, got {devices}")


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> RMSNormResult:
    """out = rmsnorm(x + residual) * weight; does not mutate its inputs.

    x:        [T, H] float32 | bfloat16 | float16, any device; rows may be strided, the
              last dim must be contiguous (it is made so otherwise).
    weight:   [H], any float dtype, same device.
    residual: [T, H] x.dtype, same device, or None.
    The sum x + residual is computed in float32 and rounded to x.dtype (new_residual); out
    normalises that rounded sum in float32, times weight in float32, cast to x.dtype.
    Without a residual new_residual is `x` itself (no copy). T = 0 launches nothing.
    """
    _check_args(x, weight, residual)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    new_residual = x if residual is None else torch.empty_like(out)
    if num_tokens == 0:
        return RMSNormResult(out, new_residual)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    weight = weight.contiguous()
    block = next_power_of_2(hidden)
    kernel = load_triton_module("_rmsnorm_triton").rmsnorm_kernel
    kernel[(num_tokens,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        new_residual,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        new_residual.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return RMSNormResult(out, new_residual)


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> RMSNormResult:
    """Torch version of `rmsnorm` (same contract and rounding)."""
    _check_args(x, weight, residual)
    new_residual = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    h = new_residual.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return RMSNormResult((h * weight.float()).to(x.dtype), new_residual)
