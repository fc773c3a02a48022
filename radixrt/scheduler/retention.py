"""Retention hints: a finished request's context (prompt and output) stays cached for
`cache_ttl_s` seconds (`SamplingParams.cache_ttl_s`), e.g. an agent's context while it waits
for a tool call.

A hold is a lock on the sequence's cached path, taken when the request finishes (its finish
just inserted it). Held blocks are evicted only after every unheld entry: when the pool is short
and nothing else is evictable, the KV manager asks `reclaim` to give up holds (the soonest to
expire first), and the path becomes an ordinary LRU entry again, which a host tier writes back
rather than drops. Bounds: the held blocks stay within `retention_max_share` of the pool
(a new hold ends the holds on prefixes of its sequence, then releases the oldest ones, or is
not taken when it alone is too large), a
TTL is capped at `retention_max_ttl_s`, a hold ends on time (checked each step) or early
(`release`, e.g. when a program ends). A request finished by abort or error holds nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixrt.config import SchedulerConfig
from radixrt.plan import BlockOp
from radixrt.scheduler.features import SchedulerFeature
from radixrt.scheduler.kv_manager import KVManager
from radixrt.scheduler.request import FinishReason, Request
from radixrt.stats import SchedulerCounters


@dataclass
class Hold:
    handle: Any  # the locked cache path
    expires: float  # clock time
    num_blocks: int  # device blocks of the path when the hold was taken
    tokens: list[int]  # the held sequence
    salt: str | None  # its cache salt


class RetentionFeature(SchedulerFeature):
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVManager,
        stats: SchedulerCounters,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv
        self.stats = stats
        self.clock = clock
        self.max_ttl_s = cfg.retention_max_ttl_s
        self.max_blocks = int(cfg.retention_max_share * kv.allocator.num_blocks)
        self.holds: dict[str, Hold] = {}  # by request id, oldest first
        kv.reclaim = self.reclaim

    @property
    def num_held_blocks(self) -> int:
        return sum(h.num_blocks for h in self.holds.values())

    def before_schedule(self, ops: list[BlockOp]) -> None:
        if self.holds:
            now = self.clock()
            for rid in [r for r, h in self.holds.items() if h.expires <= now]:
                self._drop(rid)
                self.stats.retention_expired += 1

    def after_update(self, changed: list[Request]) -> None:
        for req in changed:
            if req.params.cache_ttl_s > 0 and req.finish_reason in (
                FinishReason.STOP,
                FinishReason.LENGTH,
            ):
                self._hold(req)

    def _hold(self, req: Request) -> None:
        cache = self.kv.cache
        m = cache.match(req.seq_token_ids, req.cache_salt)  # what its finish inserted
        if m.num_cached_tokens == 0 or len(m.blocks) > self.max_blocks:
            return
        self.release(req.rid)  # a request id held again: the newer hold counts
        tokens = req.seq_token_ids
        for rid, h in list(self.holds.items()):  # holds the new one covers (an agent's
            # earlier steps: its next step extends the context) end now
            if h.salt == req.cache_salt and tokens[: len(h.tokens)] == h.tokens:
                self._drop(rid)
        while self.holds and self.num_held_blocks + len(m.blocks) > self.max_blocks:
            self._drop(next(iter(self.holds)))
            self.stats.retention_released += 1
        cache.lock(m.handle)
        ttl = min(req.params.cache_ttl_s, self.max_ttl_s)
        self.holds[req.rid] = Hold(
            m.handle, self.clock() + ttl, len(m.blocks), tokens, req.cache_salt
        )
        self.stats.retention_holds += 1

    def release(self, rid: str) -> bool:
        """End the hold of request `rid` early; False when it has none."""
        if rid not in self.holds:
            return False
        self._drop(rid)
        return True

    def reclaim(self, num_blocks: int) -> None:
        """The pool is short of `num_blocks` with nothing else evictable: give up holds, the
        soonest to expire first, until that many blocks could be evicted (or none is left)."""
        freed = 0
        for rid in sorted(self.holds, key=lambda r: self.holds[r].expires):
            if freed >= num_blocks:
                break
            freed += self.holds[rid].num_blocks
            self._drop(rid)
            self.stats.retention_released += 1

    def _drop(self, rid: str) -> None:
        self.kv.cache.unlock(self.holds.pop(rid).handle)

    def check_integrity(self) -> None:
        assert self.num_held_blocks <= self.max_blocks
