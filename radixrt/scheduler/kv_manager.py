"""The KV state of the scheduler's requests: blocks, row slots, the prefix cache and the block
operations of the next plan (plain Python; it owns this state, nothing else changes it).

A running request holds a block table (references through the `BlockAllocator`), a lock on
its cached path (`cache_handle`) and a runner row slot. `start` gives a waiting request its
cached prefix (whole blocks by reference, a partial last block written on in place or copied:
a `CopyBlock` op, host-resident blocks loaded: `SwapIn` ops); `share_prefix` does the same
between two requests (forks, beams); `reserve` adds blocks for the next tokens, evicting cache
entries when the pool is short; `release` gives everything back. Block ops made outside
`schedule()` (beam re-parenting while a result is applied) wait in `pending_ops`, which is
also the list a step's planning appends to until the plan takes it; the host tier's swap ops
come from the cache (`swaps_first`). A block freed before its plan goes out loses the copy
queued into it (`free`): the block may be reused at once, e.g. as a host load's target, and a
plan runs its swap-ins before its copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from radixrt.cache.base import MatchResult, PrefixCache, host_tier_of
from radixrt.kv.allocator import BlockAllocator
from radixrt.plan import BlockOp, CopyBlock, SwapIn, SwapOut
from radixrt.scheduler.request import Request
from radixrt.scheduler.slot_entries import SlotEntries
from radixrt.stats import SchedulerCounters


class KVManager:
    def __init__(
        self,
        allocator: BlockAllocator,
        cache: PrefixCache,
        num_slots: int,
        stats: SchedulerCounters,
        on_blocks_short: list[Callable[[int, Request | None], None]] = (),
    ) -> None:
        """`on_blocks_short`: the features' hooks for a pool short of blocks with nothing else
        evictable (radixrt.scheduler.features)."""
        self.allocator = allocator
        self.cache = cache
        self.block_size = cache.block_size
        self.num_slots = num_slots  # runner row slots: one per running sequence
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.entries = SlotEntries()  # per-request data for the runner's slots (next plan)
        self.stats = stats
        # Block ops made while applying a result (beam re-parenting), for the next plan.
        self.pending_ops: list[BlockOp] = []
        # the cache with its host KV tier, None without one
        self.host_cache = host_tier_of(cache)
        self.on_blocks_short = on_blocks_short  # the features' (retention gives up holds)

    # ---- blocks ----
    def allocate(self, n: int, req: Request | None = None) -> list[int] | None:
        """`n` fresh blocks (evicting unlocked cache entries when short, then retention holds
        `req` may take: see radixrt.scheduler.retention), or None."""
        short = n - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
            short = n - self.allocator.num_free
            if short > 0 and self.on_blocks_short:
                for hook in self.on_blocks_short:
                    hook(short, req)
                self.cache.evict(short)
            if self.allocator.num_free < n:
                return None
        return self.allocator.allocate(n)

    def reserve(self, req: Request, n: int) -> bool:
        """Make sure `req` has blocks for its next `n` tokens; False (nothing taken) when the
        pool cannot provide them."""
        need = math.ceil((req.num_computed + n) / self.block_size) - len(req.block_table)
        if need <= 0:
            return True
        blocks = self.allocate(need, req)
        if blocks is None:
            return False
        req.block_table += blocks
        return True

    def truncate(self, req: Request) -> None:
        """Free blocks past the request's computed KV (speculative rollback)."""
        keep = math.ceil(req.num_computed / self.block_size)
        if keep < len(req.block_table):
            self.free(req.block_table[keep:])
            del req.block_table[keep:]
            req.num_table_sent = min(req.num_table_sent, keep)

    def free(self, blocks: list[int]) -> None:
        """Drop a request's reference on each of `blocks`; a copy queued for the next plan
        into a block that became free goes too (see the module docstring)."""
        self.allocator.decref(blocks)
        ref_counts = self.allocator.ref_counts
        freed = {b for b in blocks if ref_counts[b] == 0}
        if freed and self.pending_ops:
            self.pending_ops[:] = [
                op for op in self.pending_ops if not (isinstance(op, CopyBlock) and op.dst in freed)
            ]

    def can_finish(self, req: Request) -> bool:
        """Whether the blocks free or evictable now cover the rest of `req` (all its tokens to
        come)."""
        total = math.ceil(
            (len(req.seq_token_ids) + req.max_tokens - req.num_output) / self.block_size
        )
        return self.allocator.num_free + self.cache.evictable_blocks >= total - len(req.block_table)

    # ---- slots ----
    def take_slot(self) -> int:
        return self.free_slots.pop()

    def give_slots(self, slots: list[int]) -> None:
        self.free_slots += slots

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    # ---- taking and giving back a prefix ----
    def start(self, req: Request, m: MatchResult, ops: list[BlockOp]) -> bool:
        """Give waiting `req` its cached prefix `m` (matched this step): lock it, take a slot
        and the prefix's blocks (a partial last block is written on in place when nothing
        else can see past its matched tokens, else copied: a CopyBlock op in `ops`; a
        host-resident tail is loaded: SwapIn ops the cache queues). Returns False, holding
        nothing, when blocks are short."""
        bs = self.block_size
        self.cache.lock(m.handle)
        req.cache_handle = m.handle
        req.slot = self.take_slot()
        self.entries.enter(req)
        req.num_host_cached_tokens = m.num_host_tokens
        if m.num_host_tokens:  # host tier: load the host-resident tail of the match
            assert self.host_cache is not None
            table = self.host_cache.load(m.handle)
            if table is None:
                self.release(req)
                return False
            m = m._replace(blocks=table, num_host_tokens=0)
        req.num_table_sent = 0
        if req.params.prompt_logprobs:
            req.prompt_logprobs = []
        full, partial = divmod(m.num_cached_tokens, bs)
        shared = m.blocks[:full]
        self.allocator.incref(shared)
        req.block_table = list(shared)
        if partial:
            last = m.blocks[full]
            if self.allocator.ref_counts[last] == 1:
                # Only the cache node that ends the match records this block (a second
                # node, e.g. after a split, or any request would hold another reference),
                # so nothing lives past the matched tokens: append in place, no copy.
                self.allocator.incref([last])
                req.block_table.append(last)
                self.stats.inplace_appends += 1
            else:
                copy = self.allocate(1, req)
                if copy is None:
                    self.release(req)
                    return False
                ops.append(CopyBlock(last, copy[0], partial))
                self.stats.cow_copies += 1
                req.block_table += copy
        req.num_computed = req.num_kv_done = m.num_cached_tokens
        return True

    def share_prefix(
        self, src: Request, dst: Request, copy: int | None, ops: list[BlockOp]
    ) -> None:
        """Give `dst` references to `src`'s full blocks and, when `src`'s computed KV ends
        inside a block, block `copy` with those tokens copied in (a CopyBlock op); `dst`
        locks `src`'s cached path too."""
        full, partial = divmod(src.num_computed, self.block_size)
        shared = src.block_table[:full]
        self.allocator.incref(shared)
        dst.block_table = list(shared)
        if partial:
            assert copy is not None
            ops.append(CopyBlock(src.block_table[full], copy, partial))
            dst.block_table.append(copy)
        dst.num_table_sent = 0
        dst.num_computed = dst.num_kv_done = src.num_computed
        if src.cache_handle is not None:
            self.cache.lock(src.cache_handle)
        dst.cache_handle = src.cache_handle

    def release(self, req: Request) -> None:
        """Give back the request's blocks, lock and slot (a group parent's reserved slots
        too); forget in-flight samples."""
        if req.cache_handle is not None:
            self.cache.unlock(req.cache_handle)
            req.cache_handle = None
        self.free(req.block_table)
        req.block_table = []
        if req.slot is not None:
            self.entries.drop(req.slot)
            self.free_slots.append(req.slot)
            req.slot = None
        g = req.group
        if g is not None and req is g.parent:
            self.free_slots += g.reserved_slots
            g.reserved_slots = []
        req.num_computed = req.num_kv_done = req.num_table_sent = 0
        req.num_inflight_samples = 0
        req.awaiting_result_for = ()

    # ---- the prefix cache ----
    def cache_progress(self, req: Request, end: int) -> None:
        """Insert the first `end` computed tokens so others can share them; the request's
        lock moves to the deeper node."""
        result = self.cache.insert(
            req.seq_token_ids[:end], req.block_table, req.cache_namespace, req.priority
        )
        self.cache.lock(result.handle)
        self.cache.unlock(req.cache_handle)
        req.cache_handle = result.handle

    def cache_finished(self, req: Request) -> None:
        """Insert what executed steps computed of a finishing request (a step in flight may
        still write the rest: that is not cached)."""
        done = min(req.num_kv_done, len(req.seq_token_ids))
        if done:
            self.cache.insert(
                req.seq_token_ids[:done], req.block_table, req.cache_namespace, req.priority
            )

    # ---- block ops ----
    def swaps_first(self, ops: list[BlockOp]) -> list[BlockOp]:
        """`ops` with the host tier's swap ops (earlier pending ones, then those the cache
        made since) first, then the copies. Swaps never touch a copy's blocks (a copy reads
        a locked block and writes a fresh one), so running them first is safe, and the
        runner can start every transfer before the step's device work."""
        queued = self.host_cache.take_swap_ops() if self.host_cache is not None else []
        swaps = [op for op in ops if is_swap(op)] + queued
        return swaps + [op for op in ops if not is_swap(op)]

    def step_ops(self) -> list[BlockOp]:
        """The list a step's planning appends its block ops to: `pending_ops` itself (ops
        queued since the last plan first), so that `free` drops copies into blocks freed
        while planning. The plan takes them with `launch_ops`."""
        return self.pending_ops

    def launch_ops(self) -> list[BlockOp]:
        """The step's block ops for its plan, swaps first; nothing stays pending."""
        ops = self.swaps_first(self.pending_ops)
        self.pending_ops = []
        return ops

    def keep_ops(self) -> None:
        """No plan this step: the ops wait for the next one (swaps first)."""
        self.pending_ops = self.swaps_first(self.pending_ops)

    # ---- integrity ----
    def check_integrity(
        self, running: list[Request], idle: list[Request], reserved_slots: list[int]
    ) -> None:
        """Every block reference is accounted for (the cache's plus the running requests'),
        idle sequences hold nothing, and every slot is free, running or reserved once."""
        refs = self.cache.held_refs()
        for req in running:
            refs.update(req.block_table)
            assert len(req.block_table) >= math.ceil(req.num_computed / self.block_size)
            assert req.slot is not None and 0 <= req.num_inflight_samples <= 1
        for req in idle:
            assert not req.block_table and req.cache_handle is None and req.slot is None
        slots = [r.slot for r in running] + reserved_slots
        assert len(set(slots)) == len(slots) and not set(slots) & set(self.free_slots)
        assert len(slots) + len(self.free_slots) == self.num_slots, "slot leaked"
        self.allocator.check_integrity(refs)
        self.cache.check_integrity()
        in_use = {b for r in running for b in r.block_table}
        for op in self.pending_ops:  # a copy into a freed block would clobber its next use
            assert not isinstance(op, CopyBlock) or op.dst in in_use, f"{op} into a free block"
        cached_only = set(self.cache.held_refs()) - in_use
        assert len(cached_only) <= self.cache.cached_blocks
        free, num_in_use, num_cached = self.allocator.num_free, len(in_use), len(cached_only)
        assert free + num_cached + num_in_use == self.allocator.num_blocks, (
            f"free {free} + cached {num_cached} + in use {num_in_use} "
            f"!= total {self.allocator.num_blocks}"
        )


def is_swap(op: object) -> bool:
    return isinstance(op, SwapIn | SwapOut)
