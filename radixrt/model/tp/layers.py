"""Tensor-parallel layers: the same parameters (and names) as `Linear` (radixrt.model.linear:
nn.Linear + CPU prepacking) / nn.Embedding with the local shapes of a `TPShard`, plus the
collective that makes their outputs whole.

Used only when tensor_parallel_size > 1; with one rank the model keeps plain `Linear` and
nn.Embedding (no extra op). Column-parallel linears (qkv, gate_up) are plain `Linear` (or
`Fp8Linear`) of the local output size: their outputs stay split (heads / features) until a
row-parallel layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from radixrt.kernels.fp8_quant import Fp8Activation
from radixrt.model.fp8_linear import Fp8Linear
from radixrt.model.linear import Linear
from radixrt.model.tp.group import TPGroup
from radixrt.quantization import Fp8Scheme
from radixrt.tp_shard import TPShard


class RowParallelLinear(Linear):
    """y = all_reduce(x_local @ W_local^T): input features split across ranks, no bias."""

    def __init__(self, in_local: int, out_features: int, group: TPGroup) -> None:
        super().__init__(in_local, out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))

    def forward_adding(
        self, x: torch.Tensor, add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """all_reduce(add(x_local @ W_local^T, x_local)): `add` puts a term of this rank's
        input features (its part of a LoRA delta) into the partial sum, in place, and the
        one all-reduce sums both over ranks."""
        return self.group.all_reduce(add(super().forward(x), x))


class Fp8RowParallelLinear(Fp8Linear):
    """`RowParallelLinear` with fp8 weights: each rank quantizes its own input slice (its
    dynamic activation scales are its own; partial products are in the model dtype, their
    scales applied, before the all-reduce: `product` is `forward`, never unscaled).
    Per-channel weight scales are per output row: whole on every rank."""

    def __init__(self, in_local: int, out_features: int, scheme: Fp8Scheme, group: TPGroup):
        super().__init__(in_local, out_features, scheme)
        self.group = group

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))

    def product(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        return self.forward(x)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [shard.vocab_start, + vocab_per_rank) of the embedding; ids outside give zeros
    here, and the all-reduce adds the rank that holds them."""

    def __init__(self, shard: TPShard, hidden_size: int, group: TPGroup) -> None:
        super().__init__(shard.vocab_per_rank, hidden_size)
        self.start = shard.vocab_start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0))
        return self.group.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))


class VocabParallelLMHead(Linear):
    """Logits of this rank's vocabulary rows; `forward` all-gathers them into the full
    [S, vocab] on every rank (padding columns dropped)."""

    def __init__(self, shard: TPShard, hidden_size: int, group: TPGroup) -> None:
        super().__init__(hidden_size, shard.vocab_per_rank, bias=False)
        self.vocab_size = shard.vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather_last(super().forward(x))
        return logits[:, : self.vocab_size]
