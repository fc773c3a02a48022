"""Per-tensor KV scales of an fp8 KV cache (plain Python, no torch).

Semantics (as vLLM's fp8 checkpoints): the pool stores `x / scale` rounded to float8_e4m3fn
(clamped to +-FP8_E4M3_MAX), and a stored value `s` means `s * scale`. One scale for K and
one for V per layer; 1.0 when the checkpoint has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn; larger magnitudes would become NaN


@dataclass(frozen=True)
class KVScales:
    k: tuple[float, ...]  # [num_layers]: dequantized K = stored K * k[layer]
    v: tuple[float, ...]  # [num_layers]: dequantized V = stored V * v[layer]
    source: str  # where they came from: "default" (1.0) or the checkpoint dir

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"KVScales: {len(self.k)} k scales but {len(self.v)} v scales")
        for name, values in (("k", self.k), ("v", self.v)):
            bad = [x for x in values if not (math.isfinite(x) and x > 0)]
            if bad:
                raise ValueError(f"KV {name} scales must be finite and > 0, got {bad[:3]}")

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers, "default")

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def all_ones(self) -> bool:
        return all(x == 1.0 for x in self.k + self.v)

    def describe(self) -> str:
        """One line for the startup log."""
        if self.all_ones:
            return f"scales 1.0 ({self.source})"
        return (
            f"scales from {self.source}: k {min(self.k):.4g}..{max(self.k):.4g}, "
            f"v {min(self.v):.4g}..{max(self.v):.4g}"
        )
