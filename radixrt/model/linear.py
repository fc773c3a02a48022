"""`Linear`: nn.Linear with an optional oneDNN-prepacked copy of its weight for CPU float32.

MKL's sgemm behind `F.linear` reaches ~70-85 GFLOP/s on one AMD EPYC core for the tiny model's
prefill shapes; oneDNN with the weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`) runs the same GEMMs at ~100-106 GFLOP/s. In a model
forward the weights stream from L3 (the tiny model's 7.8 MB of linears do not fit a 1 MB L2), and
there the blocked layout also wins for decode batches: the tiny model's 21 decode GEMMs in a row
took 1.52 vs 1.83 ms at 32 rows, 0.90 vs 0.94 at 16, 0.65 vs 0.65 at 8, but 0.44 vs 0.24 ms at
one row (oneDNN's per-call overhead; with one hot weight it is also slower at 2-8 rows). So
`forward` takes the packed path for inputs of at least `PACKED_MIN_ROWS` rows, and plain
`F.linear` below (benchmarks/bench_cpu_paired.py measures the whole run).

Numerics: oneDNN sums the K products in another order than MKL, so results
differ in the last bits (relative ~1e-6 in float32; tests/test_cpu_linear.py bounds it against
`F.linear`).

Memory: oneDNN builds (and caches, ~1,024 entries) one primitive per input shape, each a few
hundred KB; a server's prefill chunks come in every row count, so the caches grew the scheduler
process for as long as it met new row counts (benchmarks/soak.py). The packed path therefore
pads its rows up to `padded_rows(rows)` (under 1/8 more rows, 8 sizes per power of two), which
bounds the shapes it ever sees.

Contract: `prepack()` snapshots the weight; a packed copy is used only while the weight is
unchanged (its version counter is checked on every call, and a changed weight falls back to
`F.linear` until `prepack()` runs again). The packed copy doubles the weight's memory: a CPU
model holds its weights once (what `F.linear` reads below `PACKED_MIN_ROWS`) plus this copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_MIN_ROWS = 8  # rows from which the packed oneDNN GEMM beats MKL's (see above)
PACK_HINT_ROWS = 128  # batch-size hint of oneDNN's weight reorder (the layout is the same)
EXACT_ROWS = 64  # row counts below this run as they are (one shape each)
ROW_BUCKETS_PER_DOUBLING = 8  # padded row counts per power of two above (padding < 1/8)


def padded_rows(rows: int) -> int:
    """The row count the packed GEMM runs at for `rows` input rows: `rows` below EXACT_ROWS,
    else rounded up to a multiple of 1/ROW_BUCKETS_PER_DOUBLING of the power of two at or
    below it, so a bounded set of shapes reaches oneDNN (see the module docstring)."""
    if rows < EXACT_ROWS:
        return rows
    step = (1 << (rows.bit_length() - 1)) // ROW_BUCKETS_PER_DOUBLING
    return -(-rows // step) * step


def _packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., in] @ packed `weight` (+ bias) -> [..., out] contiguous, run at `padded_rows`."""
    in_features = x.shape[-1]
    flat = x.reshape(-1, in_features)
    rows = flat.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, in_features)])
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def can_prepack(weight: torch.Tensor) -> bool:
    """True where a oneDNN-packed linear applies: a float32 CPU weight, oneDNN built in."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


class Linear(nn.Linear):
    """nn.Linear (same parameters, names and state dict) plus `prepack()` for CPU float32.

    `row_parts`: (start, stop) ranges of output features that `forward_rows` computes on their
    own (e.g. gate and up of a merged gate_up weight); with them, `prepack` packs only those
    parts (and `forward` of the whole layer stays on `F.linear`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        row_parts: tuple[tuple[int, int], ...] = (),
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        for start, stop in row_parts:
            if not 0 <= start < stop <= out_features:
                raise ValueError(f"row_parts: ({start}, {stop}) is not in [0, {out_features}]")
        self.row_parts = row_parts
        # (start, stop) -> (oneDNN blocked copy of weight[start:stop], bias[start:stop] or
        # None) ((0, out): the whole)
        self._packed: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._full: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the whole's
        self._packed_version = -1  # weight._version when packed

    def prepack(self) -> bool:
        """Make the oneDNN-packed copies of the current weight (the whole, or `row_parts`;
        see the module docstring). Returns whether they were made (False: not a float32 CPU
        weight, or no oneDNN)."""
        self._packed, self._full = {}, None
        if not can_prepack(self.weight):
            return False
        parts = self.row_parts or ((0, self.out_features),)
        with torch.no_grad():
            w = self.weight.detach()
            for start, stop in parts:
                packed = torch.ops.mkldnn._reorder_linear_weight(
                    w[start:stop].contiguous(), PACK_HINT_ROWS
                )
                bias = None if self.bias is None else self.bias[start:stop]  # a view
                self._packed[(start, stop)] = (packed, bias)
        self._full = self._packed.get((0, self.out_features))
        self._packed_version = self.weight._version
        return True

    @property
    def is_packed(self) -> bool:
        """Whether packed copies exist and the weight is unchanged since they were made."""
        return bool(self._packed) and self._packed_version == self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]; the packed oneDNN GEMM for >= PACKED_MIN_ROWS rows."""
        full = self._full
        if full is None or x.numel() < PACKED_MIN_ROWS * self.in_features or not x.is_cpu:
            return F.linear(x, self.weight, self.bias)
        if self._packed_version != self.weight._version:
            return F.linear(x, self.weight, self.bias)
        return _packed_linear(x, full[0], full[1])

    def forward_rows(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """x [..., in] -> output features [start, stop) [..., stop - start], contiguous."""
        packed = self._packed.get((start, stop))
        if (
            packed is not None
            and x.numel() >= PACKED_MIN_ROWS * self.in_features
            and x.is_cpu  # a model moved off the CPU after prepack() keeps F.linear
            and self._packed_version == self.weight._version
        ):
            return _packed_linear(x, packed[0], packed[1])
        bias = None if self.bias is None else self.bias[start:stop]
        return F.linear(x, self.weight[start:stop], bias)


def prepack_linears(model: nn.Module) -> int:
    """`prepack()` every `Linear` of `model`; returns how many were packed."""
    return sum(m.prepack() for m in model.modules() if isinstance(m, Linear))
