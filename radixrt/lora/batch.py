"""One forward's LoRA delta over rows of several adapters and the base model (torch).

The slot weights (`LayerLora`, filled by `radixrt.lora.slots.LoraSlots`) are, per layer and
merged projection,

    a     [in, L * P * R]   the A matrices, transposed: column (slot, part, r)
    b[p]  [L * R, out_p]    part p's B matrices times the adapter's scaling: row (slot, r)

Two implementations of `LoraBatch.apply` read them; `LoraSlots` picks one at construction:

- `SegmentedLoraBatch` (CUDA): radixrt.kernels.lora's segmented shrink and expand; each
  adapted token multiplies its own slot's weights only, base tokens are skipped.
- `MaskedLoraBatch` (CPU, torch ops): one shrink GEMM over the slots in use, each token's
  columns of other slots zeroed (a 0/1 mask, all zeros for base rows), one expand GEMM per
  part. Its cost grows with the slots in use (m * P * R columns per token), which is cheap
  on CPU for a few adapters and needs no kernel.

Both are one launch sequence for any mix of adapters (no loop over adapters), and a row's
output does not depend on its batch (zeroed columns contribute exact zeros). A decode CUDA
graph captures a `SegmentedLoraBatch` over padded segments at fixed addresses
(`radixrt.kernels.lora.StaticLoraSegments`), which each replay's step refills.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from radixrt.kernels.lora import LoraSegments, lora_expand_add, lora_shrink


@dataclass
class LayerLora:
    """One merged projection's slot weights (see the module docstring)."""

    a: torch.Tensor  # [in, L * P * R]
    b: list[torch.Tensor]  # P x [L * R, out_p]
    out_ranges: list[tuple[int, int]]  # part p's output features [start, stop)


class LoraBatch(Protocol):
    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """Add the LoRA delta of `module` (a merged projection) in layer `layer` for input x
        [T, in] to its base output `out` [T, out] (in place); returns out."""
        ...


@dataclass
class MaskedLoraBatch:
    """The torch implementation (see the module docstring)."""

    layers: list[dict[str, LayerLora]]
    mask: torch.Tensor  # [T, m] model dtype: 1 at (token, its adapter's slot), else 0
    num_used: int  # m: slots [0, m) are read (the highest slot of the step + 1)
    rank: int  # R: columns per slot and part

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        w = self.layers[layer][module]
        m, R, T = self.num_used, self.rank, x.shape[0]
        P = len(w.b)
        shrunk = torch.mm(x, w.a[:, : m * P * R]).view(T, m, P, R)
        shrunk.mul_(self.mask.view(T, m, 1, 1))
        for p, (start, stop) in enumerate(w.out_ranges):
            part = shrunk[:, :, p].reshape(T, m * R)
            out[:, start:stop].addmm_(part, w.b[p][: m * R])
        return out


@dataclass
class SegmentedLoraBatch:
    """The Triton implementation (see the module docstring)."""

    layers: list[dict[str, LayerLora]]
    segments: LoraSegments  # the adapted tokens grouped by slot
    rank: int  # R

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        w = self.layers[layer][module]
        R = self.rank
        shrunk = lora_shrink(x, w.a, self.segments, len(w.b) * R)  # [N, P * R]
        for p, (start, stop) in enumerate(w.out_ranges):
            lora_expand_add(
                out[:, start:stop], shrunk[:, p * R : (p + 1) * R], w.b[p], self.segments, R
            )
        return out
