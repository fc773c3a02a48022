"""The KV tiers below the device, seen from the radix tree: `KVTier`, what a tier layer of the
tree (`radixrt.cache.radix_host.HostRadixCache`) needs of the store it keeps node copies in;
`HostTier`, the host tier's (a host block allocator and the swap ops to send); and
`unmade_blocks`, what a failed step may have left unwritten.

Plain Python (no torch): the runner holds the host tensors (`radixrt.kv.host_pool`). The tree's
layer decides what moves: evicting a device leaf writes its blocks back (`SwapOut`, one host
block per device block) unless the node already has a host copy; loading a host-resident node
into fresh device blocks is a `SwapIn`. The ops collect here in the order the layer made them
and go, first, into the next plan (`take_ops`); the runner executes them in list order, before
that step's copies and forward, so every op reads what earlier ops and steps wrote.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from radixrt.kv.allocator import BlockAllocator
from radixrt.plan import BlockOp, CopyBlock, SwapIn, SwapOut


@dataclass
class TierStats:
    num_written_back_blocks: int = 0  # device blocks copied to the host (SwapOut ops of
    # plans that did not fail)
    num_loaded_blocks: int = 0  # host blocks copied into fresh device blocks (SwapIn ops of
    # plans that did not fail)
    num_host_evicted_blocks: int = 0  # host blocks freed by the host tier's own eviction
    # (order: radixrt.cache.radix_host.host_eviction_key)
    num_dropped_blocks: int = 0  # device blocks freed by evicting a leaf that got no host
    # copy (the host could not make room)


class KVTier(Protocol):
    """A store of KV blocks below the device that a tier layer of the radix tree keeps node
    copies in. Its blocks are reference counted by the nodes recording them (`allocator`);
    copies between it and the device are queued as block ops, in the order they were made,
    for the scheduler's next plan."""

    allocator: BlockAllocator  # the tier's blocks
    stats: TierStats

    def write_back(self, device_blocks: list[int], tier_blocks: list[int]) -> None:
        """Queue copies of `device_blocks` into `tier_blocks` (pairwise)."""
        ...

    def load(self, tier_blocks: list[int], device_blocks: list[int]) -> None:
        """Queue copies of `tier_blocks` into `device_blocks` (pairwise)."""
        ...

    def take_ops(self) -> list[SwapIn | SwapOut]:
        """The ops queued since the last call, in the order they were made (clears them)."""
        ...

    @property
    def pending_ops(self) -> list[SwapIn | SwapOut]:
        """The ops queued since the last `take_ops` (a copy; they stay queued)."""
        ...

    def uncount(self, ops: Iterable[BlockOp]) -> None:
        """Take the ops of a failed plan out of the counters."""
        ...


class HostTier:
    """Host block allocator plus the outbox of swap ops (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs >= 1 block, got {num_blocks}")
        self.allocator = BlockAllocator(num_blocks)
        self.stats = TierStats()
        self._ops: list[SwapIn | SwapOut] = []

    def write_back(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Queue copies of `device_blocks` into `host_blocks` (pairwise)."""
        assert len(device_blocks) == len(host_blocks)
        self._ops += [SwapOut(d, h) for d, h in zip(device_blocks, host_blocks)]
        self.stats.num_written_back_blocks += len(device_blocks)

    def load(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Queue copies of `host_blocks` into `device_blocks` (pairwise)."""
        assert len(device_blocks) == len(host_blocks)
        self._ops += [SwapIn(h, d) for h, d in zip(host_blocks, device_blocks)]
        self.stats.num_loaded_blocks += len(device_blocks)

    def take_ops(self) -> list[SwapIn | SwapOut]:
        """The ops queued since the last call, in the order they were made (clears them)."""
        ops, self._ops = self._ops, []
        return ops

    @property
    def pending_ops(self) -> list[SwapIn | SwapOut]:
        """The ops queued since the last `take_ops` (a copy; they stay queued)."""
        return list(self._ops)

    def uncount(self, ops: Iterable[BlockOp]) -> None:
        """Take the swap ops of a failed plan out of the counters."""
        for op in ops:
            if isinstance(op, SwapOut):
                self.stats.num_written_back_blocks -= 1
            elif isinstance(op, SwapIn):
                self.stats.num_loaded_blocks -= 1


def unmade_blocks(
    failed_ops: Iterable[BlockOp], later_ops: Iterable[Iterable[BlockOp]]
) -> tuple[set[int], set[int]]:
    """Device and host blocks whose content may be wrong after a plan with `failed_ops`
    failed (it may have run none, some or all of them): the targets of its swap-ins, copies
    and swap-outs, and, through `later_ops` (the ops of plans made after it and of ops queued
    since, in the order they run), the targets of ops that read such a block."""
    device: set[int] = set()
    host: set[int] = set()
    for op in failed_ops:
        if isinstance(op, SwapIn):
            device.add(op.device_block)
        elif isinstance(op, SwapOut):
            host.add(op.host_block)
        elif isinstance(op, CopyBlock):
            device.add(op.dst)
    for ops in later_ops:
        for op in ops:
            if isinstance(op, SwapIn) and op.host_block in host:
                device.add(op.device_block)
            elif isinstance(op, SwapOut) and op.device_block in device:
                host.add(op.host_block)
            elif isinstance(op, CopyBlock) and op.src in device:
                device.add(op.dst)
    return device, host
