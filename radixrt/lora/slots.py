"""Adapter weights on the device and one forward's LoRA inputs (torch).

`LoraSlots` keeps `max_loras` device slots of adapter weights, filled least-recently-used
first from a host cache of `max_cpu_loras` adapters (read from their directories on a miss).
For every layer and merged projection (qkv_proj, o_proj, gate_up_proj, down_proj) it holds
the slot-major weights that `radixrt.lora.batch` describes (an adapter of rank r < R and a
projection it does not adapt leave zeros), and makes each forward's `LoraBatch`: the
segmented Triton kernels on CUDA (where Triton is installed), torch ops elsewhere (chosen
at construction). Under tensor parallelism each rank's pool holds its shard of every adapter
(`radixrt.lora.shard`): the shapes of its base layers' shards, read from the same directory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load_file

from radixrt.config import ModelConfig
from radixrt.kernels import HAS_TRITON
from radixrt.kernels.lora import LoraSegments, build_lora_segments
from radixrt.lora.adapter import (
    SERVED_MODULES,
    WEIGHTS_FILE,
    adapter_scaling,
    digest,
    parse_tensor_name,
    read_config,
)
from radixrt.lora.batch import LayerLora, LoraBatch, MaskedLoraBatch, SegmentedLoraBatch
from radixrt.lora.shard import local_module_shapes, shard_lora_pair
from radixrt.sampling import LoraRef
from radixrt.tp_shard import TPShard

# merged projection -> the PEFT modules it is made of, in order
MERGED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass
class HostAdapter:
    """An adapter's weights in host memory: (layer, module) -> (A [r, in], B * scaling
    [out, r]), float32; a tensor-parallel rank's shard of them (in, out: its local features)."""

    ref: LoraRef
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_host_adapter(ref: LoraRef, shard: TPShard) -> HostAdapter:
    """Read `ref`'s weights from its directory, `shard`'s part of them. Raises ValueError when
    its files changed since the registry checked them (their key differs: cached KV would be
    wrong)."""
    if digest(ref.path) != ref.key:
        raise ValueError(
            f"LoRA adapter {ref.name!r}: the files in {ref.path} changed since it was loaded"
        )
    config = read_config(ref.path)
    scaling = adapter_scaling(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(f"{ref.path}/{WEIGHTS_FILE}").items():
        parsed = parse_tensor_name(name)
        assert parsed is not None and parsed[1] in SERVED_MODULES, name  # checked at load
        layer, module, kind = parsed
        pairs.setdefault((layer, module), {})[kind] = tensor.float()
    weights = {}
    for (layer, module), v in pairs.items():
        a, b = shard_lora_pair(module, v["A"], v["B"], shard)
        weights[layer, module] = (a.contiguous(), b * scaling)
    return HostAdapter(ref, config["r"], weights)


class LoraSlots:
    """See the module docstring. `token_slots` (once a step, before the forward) makes every
    adapter of the step resident (`assign`) and maps its tokens to their slots; `batch` makes
    the forward's LoraBatch from that map, `graph_batch` a CUDA graph's over fixed segments
    (`radixrt.kernels.lora.StaticLoraSegments`)."""

    def __init__(
        self,
        model: ModelConfig,
        max_loras: int,
        max_rank: int,
        host_capacity: int,
        device: torch.device,
        dtype: torch.dtype,
        segmented: bool | None = None,  # Triton kernels (None: on CUDA with Triton) or torch
        shard: TPShard | None = None,  # this tensor-parallel rank's part (None: one rank)
    ) -> None:
        self.num_slots, self.rank = max_loras, max_rank
        if segmented is None:
            segmented = device.type == "cuda" and HAS_TRITON
        self._make_batch = self._segmented_batch if segmented else self._masked_batch
        self.host_capacity = host_capacity
        self.device, self.dtype = device, dtype
        self.shard = shard or TPShard.of(model, 0, 1)
        L, R = max_loras, max_rank
        shapes = local_module_shapes(model, self.shard)
        self.layers: list[dict[str, LayerLora]] = []
        for _ in range(model.num_layers):
            layer = {}
            for merged, parts in MERGED.items():
                fan_in = shapes[parts[0]][0]
                outs = [shapes[p][1] for p in parts]
                starts = np.cumsum([0, *outs]).tolist()
                layer[merged] = LayerLora(
                    torch.zeros(fan_in, L * len(parts) * R, device=device, dtype=dtype),
                    [torch.zeros(L * R, n, device=device, dtype=dtype) for n in outs],
                    [(starts[i], starts[i + 1]) for i in range(len(parts))],
                )
            self.layers.append(layer)
        self.slot_keys: list[str | None] = [None] * L  # the adapter in each slot
        self._lru: OrderedDict[str, int] = OrderedDict()  # resident key -> slot, LRU first
        self._host: OrderedDict[str, HostAdapter] = OrderedDict()  # LRU first
        self.num_swaps_in = 0  # adapters copied into a slot
        self.num_host_reads = 0  # adapters read from their directory

    def assign(self, refs: Sequence[LoraRef]) -> dict[str, int]:
        """Slots of the distinct adapters `refs` (at most max_loras of them), loading those
        not resident into free or least recently used slots that none of them holds."""
        wanted = {ref.key: ref for ref in refs}
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} adapters in one step, max_loras={self.num_slots}")
        out = {}
        for key in wanted:
            if key in self._lru:
                self._lru.move_to_end(key)
                out[key] = self._lru[key]
        for key, ref in wanted.items():
            if key in out:
                continue
            slot = self._free_slot(set(out))
            self._fill(slot, self._host_adapter(ref))
            self._lru[key] = slot
            out[key] = slot
        return out

    def _free_slot(self, keep: set[str]) -> int:
        if None in self.slot_keys:
            return self.slot_keys.index(None)
        victim = next(k for k in self._lru if k not in keep)
        slot = self._lru.pop(victim)
        self.slot_keys[slot] = None
        return slot

    def _host_adapter(self, ref: LoraRef) -> HostAdapter:
        host = self._host.get(ref.key)
        if host is not None:
            self._host.move_to_end(ref.key)
            return host
        host = read_host_adapter(ref, self.shard)
        self.num_host_reads += 1
        self._host[ref.key] = host
        while len(self._host) > self.host_capacity:
            self._host.popitem(last=False)
        return host

    def _fill(self, slot: int, host: HostAdapter) -> None:
        """Copy `host`'s weights into `slot` (zeros where it adapts nothing)."""
        R, r = self.rank, host.rank
        for i, layer in enumerate(self.layers):
            for merged, parts in MERGED.items():
                w = layer[merged]
                P = len(parts)
                cols = w.a[:, slot * P * R : (slot + 1) * P * R]
                cols.zero_()
                for p, module in enumerate(parts):
                    rows = w.b[p][slot * R : (slot + 1) * R]
                    rows.zero_()
                    pair = host.weights.get((i, module))
                    if pair is None:
                        continue
                    a, b = pair
                    cols[:, p * R : p * R + r].copy_(a.t())
                    rows[:r].copy_(b.t())
        self.slot_keys[slot] = host.ref.key
        self.num_swaps_in += 1

    def token_slots(
        self,
        row_refs: Sequence[LoraRef | None],  # [R] each row's adapter
        num_new: np.ndarray,  # [R] int: each row's new tokens
    ) -> np.ndarray | None:
        """Each new token's slot [T] int64 in flat token order, -1 for a base row's (None when
        no row has an adapter): the adapters are made resident (`assign`) first."""
        if all(ref is None for ref in row_refs):
            return None
        slots = self.assign([ref for ref in row_refs if ref is not None])
        row_slot = np.array(
            [-1 if ref is None else slots[ref.key] for ref in row_refs], dtype=np.int64
        )
        return np.repeat(row_slot, num_new)

    def batch(self, token_slot: np.ndarray) -> LoraBatch:
        """The forward's LoRA inputs for tokens of these slots (`token_slots`' [T])."""
        return self._make_batch(token_slot)

    def graph_batch(self, segments: LoraSegments) -> SegmentedLoraBatch:
        """A LoraBatch over fixed segments (a CUDA graph's `StaticLoraSegments.view`): the
        kernels read the slots' weights, which `assign` rewrites in place."""
        return SegmentedLoraBatch(self.layers, segments, self.rank)

    def _masked_batch(self, token_slot: np.ndarray) -> MaskedLoraBatch:
        used = int(token_slot.max()) + 1
        tokens = np.nonzero(token_slot >= 0)[0]
        mask = torch.zeros(len(token_slot), used, dtype=self.dtype)
        mask[torch.from_numpy(tokens), torch.from_numpy(token_slot[tokens])] = 1
        mask = mask.to(self.device, non_blocking=True)
        return MaskedLoraBatch(self.layers, mask, used, self.rank)

    def _segmented_batch(self, token_slot: np.ndarray) -> SegmentedLoraBatch:
        segments = build_lora_segments(torch.from_numpy(token_slot), self.device)
        return SegmentedLoraBatch(self.layers, segments, self.rank)
