"""SiLU-and-mul of a merged gate | up projection, the activation of Llama-style MLPs."""

import torch

from ._triton import cdiv, load_triton_module

BLOCK = 1024  # columns a program: Llama-3-8B's 14,336 make 14 programs a row at decode


def _check_args(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2 * I] (gate | up), got {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == torch.float8_e4m3fn:
        raise ValueError(f"x must be float32/bfloat16/float16, got {x.dtype}")


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [T, I] in x's dtype, for x = gate | up [T, 2 * I]; x is not mutated.

    Computed in float32 and rounded once (as FlashInfer's silu_and_mul; torch's two ops
    round silu(gate) to x's dtype first). Rows may be strided; the last dim is made
    contiguous if it is not. T = 0 launches nothing.
    """
    _check_args(x)
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    kernel = load_triton_module("_silu_mul_triton").silu_mul_kernel
    kernel[(num_tokens, cdiv(inter, BLOCK))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=BLOCK, num_warps=4
    )
    return out


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Torch version of `silu_mul` (same contract and rounding)."""
    _check_args(x)
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
