"""A tensor-parallel rank's part of LoRA adapter weights, split with their base layers.

A module's delta is `B @ A` (B [out, r], A [r, in]) beside a base weight W [out, in]:
- column-parallel layers (q/k/v, gate/up: W split along its output rows) keep A whole and
  take B's rows of the rank's output features; the delta of the rank's outputs is
  `x @ A^T @ B_rank^T`, with no collective.
- row-parallel layers (o_proj, down_proj: W split along its input columns) take A's columns
  of the rank's input features and keep B whole; each rank's `x_rank @ A_rank^T @ B^T` is its
  part of the delta, summed by the layer's own all-reduce (added before it: no extra one).

The ranges are those of the base weights (`TPShard.checkpoint_range`), KV heads replicated
across ranks included.
"""

from __future__ import annotations

import torch

from radixrt.config import ModelConfig
from radixrt.lora.adapter import module_shapes
from radixrt.tp_shard import TPShard


def local_module_shapes(cfg: ModelConfig, shard: TPShard) -> dict[str, tuple[int, int]]:
    """(in, out) features of each served projection on `shard`'s rank (the whole model's
    with one rank)."""
    shapes = module_shapes(cfg)
    for module, (fan_in, fan_out) in shapes.items():
        part = shard.checkpoint_range(module) if shard.size > 1 else None
        if part is not None:
            dim, start, stop = part
            shapes[module] = (fan_in, stop - start) if dim == 0 else (stop - start, fan_out)
    return shapes


def shard_lora_pair(
    module: str,
    a: torch.Tensor,  # [r, in] the whole adapter's A
    b: torch.Tensor,  # [out, r] the whole adapter's B
    shard: TPShard,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of `module` on `shard`'s rank: B's output rows of a column-parallel layer, A's
    input columns of a row-parallel one (views; unchanged with one rank)."""
    part = shard.checkpoint_range(module) if shard.size > 1 else None
    if part is None:
        return a, b
    dim, start, stop = part
    if dim == 0:  # W's output rows: B's rows
        return a, b[start:stop]
    return a[:, start:stop], b  # W's input columns: A's columns
