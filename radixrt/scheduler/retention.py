"""Retention hints: a finished request's context (prompt and output) stays cached for
`cache_ttl_s` seconds (`RequestOptions.cache_ttl_s`), e.g. an agent's context while it waits
for a tool call, or a DSL program's context between its calls.

A hold is a lock on the sequence's cached path, taken when the request finishes (its finish
just inserted it). Held blocks are evicted only after every unheld entry.

Holds form lineages: a hold on a sequence that extends earlier holds (an agent's next step, a
program's next call, a fork's branch) replaces them and inherits their age, the age of the
lineage's first hold. Under pressure the youngest lineages give way first: a program that
has held its context longest is the nearest to its end (when its holds go), and keeping the
same programs' contexts is what turns a cyclic access pattern that LRU thrashes (every agent
back just after its context was evicted) into hits for the programs that fit. So:
- share bound: held blocks (distinct device blocks the holds' locks keep) stay within
  `retention_max_share` of the pool and, per tenant (`Request.tenant`, whatever cache salts
  its requests use), within its `retention_share` (default `retention_max_tenant_share`), so
  one tenant's holds leave the others a working cache; requests without a tenant (a server
  without API keys: one tenant) are bounded by `retention_max_share` only. A new hold that
  would exceed a bound ends the holds of younger lineages, youngest first (only the tenant's
  own when only its share is exceeded), and is not taken when that is not enough (the older
  lineages keep theirs, its own earlier holds too);
- when the pool is short with nothing else evictable (`on_blocks_short`), it gives up
  holds, youngest lineage first: for a running request or when nothing runs (progress), any
  hold; for a waiting request being admitted while others run, only holds of lineages younger
  than the request's own (a request that continues no hold is the youngest), so new work
  waits for unheld blocks instead of evicting the programs already under way;
- a hold ends on time (checked each step), at `retention_max_ttl_s` at most, or early
  (`release`: a program ended). A released hold is an ordinary LRU entry again, which a host
  tier writes back rather than drops. A request finished by abort or error holds nothing.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixrt.cache.namespace import CacheNamespace
from radixrt.config import SchedulerConfig
from radixrt.deltas import FinishReason
from radixrt.plan import BlockOp
from radixrt.scheduler.features import SchedulerFeature
from radixrt.scheduler.kv_manager import KVManager
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Request, RequestStatus
from radixrt.stats import SchedulerCounters
from radixrt.tenant import Tenant


@dataclass
class Hold:
    handle: Any  # the locked cache path
    expires: float  # clock time
    blocks: list[int]  # device blocks the lock keeps (every block a node of the path records)
    tokens: list[int]  # the held sequence
    salt: str | None  # its cache salt
    tenant: str | None  # its request's tenant's name, whose share it counts in (None: no tenants)
    born: int  # the lineage's age: order of its first hold (lower: older)
    namespace: CacheNamespace  # its cache namespace (salt and adapter)


class RetentionFeature(SchedulerFeature):
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVManager,
        queues: RequestQueues,
        stats: SchedulerCounters,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv
        self.queues = queues
        self.stats = stats
        self.clock = clock
        self.max_ttl_s = cfg.retention_max_ttl_s
        self.num_blocks = kv.allocator.num_blocks
        self.max_blocks = int(cfg.retention_max_share * self.num_blocks)
        self.tenant_share = cfg.retention_max_tenant_share
        self.holds: dict[str, Hold] = {}  # by request id
        self._held: Counter[int] = Counter()  # device block -> holds keeping it
        self._held_by_tenant: dict[str, Counter[int]] = {}  # tenant name -> its own counter
        self._tenant_limit: dict[str, int] = {}  # tenant name -> its bound at its last hold
        self._births = itertools.count()

    @property
    def num_held_blocks(self) -> int:
        """Distinct device blocks the holds keep (a block two holds share counts once)."""
        return len(self._held)

    def num_tenant_held_blocks(self, tenant: str) -> int:
        """Distinct device blocks the holds of tenant `tenant` (a name) keep."""
        return len(self._held_by_tenant.get(tenant, ()))

    def max_tenant_blocks(self, tenant: Tenant | None) -> int:
        """Blocks the holds of `tenant` may keep (None, no tenants: the pool's bound)."""
        if tenant is None:
            return self.max_blocks
        share = self.tenant_share if tenant.retention_share is None else tenant.retention_share
        return min(self.max_blocks, int(share * self.num_blocks))

    def before_schedule(self, ops: list[BlockOp]) -> None:
        if self.holds:
            now = self.clock()
            for rid in [r for r, h in self.holds.items() if h.expires <= now]:
                self._drop(rid)
                self.stats.retention_expired += 1

    def after_update(self, changed: list[Request]) -> None:
        for req in changed:
            if req.options.cache_ttl_s > 0 and req.finish_reason in (
                FinishReason.STOP,
                FinishReason.LENGTH,
            ):
                self._hold(req)

    def _hold(self, req: Request) -> None:
        cache, salt = self.kv.cache, req.cache_salt
        m = cache.match(req.seq_token_ids, req.cache_namespace)  # what its finish inserted
        # the sampled token (no KV) may run into an older host-only entry: hold the device
        # part, so the blocks the hold counts stay those its lock keeps (a load adds some)
        if m.num_host_tokens:
            device = m.num_cached_tokens - m.num_host_tokens
            m = cache.match(req.seq_token_ids[:device], req.cache_namespace)
        if m.num_cached_tokens == 0:
            return
        self.release(req.rid)  # a request id held again: the newer hold counts
        tokens = list(req.seq_token_ids)
        namespace = req.cache_namespace
        covered = [rid for rid, h in self.holds.items() if _extends(tokens, namespace, h)]
        born = min((self.holds[r].born for r in covered), default=None)
        if born is None:
            born = next(self._births)
        blocks = cache.locked_blocks(m.handle)
        if not self._make_room(blocks, req.tenant, born, set(covered)):
            self.stats.retention_refused += 1
            return  # the lineage keeps its earlier holds
        for rid in covered:
            self._drop(rid)
        cache.lock(m.handle)
        ttl = min(req.options.cache_ttl_s, self.max_ttl_s)
        name = None if req.tenant is None else req.tenant.name
        expires = self.clock() + ttl
        self.holds[req.rid] = hold = Hold(
            m.handle, expires, blocks, tokens, salt, name, born, namespace
        )
        if req.tenant is not None:
            self._tenant_limit[req.tenant.name] = self.max_tenant_blocks(req.tenant)
        self._count(hold, +1)
        self.stats.retention_holds += 1

    def _make_room(self, blocks: list[int], tenant: Tenant | None, born: int, leaving: set) -> bool:
        """Whether a hold on `blocks` of `tenant`'s lineage `born` fits the share bounds once
        the holds in `leaving` (its lineage's earlier ones) go. Ends holds of younger lineages
        for room (youngest first; only the tenant's own when only its share is exceeded), but
        only when that makes it fit."""
        name = None if tenant is None else tenant.name
        total = Counter(self._held)
        own = Counter(self._held_by_tenant.get(name, ())) if name is not None else Counter()
        max_own = self.max_tenant_blocks(tenant)
        new = set(blocks)

        def remove(hold: Hold) -> None:
            total.subtract(hold.blocks)
            if hold.tenant == name:
                own.subtract(hold.blocks)

        def over() -> tuple[bool, bool]:
            def size(c: Counter[int]) -> int:
                return len(new | {b for b, n in c.items() if n > 0})

            return size(total) > self.max_blocks, name is not None and size(own) > max_own

        for rid in leaving:
            remove(self.holds[rid])
        younger = sorted(
            (r for r, h in self.holds.items() if h.born > born and r not in leaving),
            key=lambda r: -self.holds[r].born,
        )
        dropped = []
        for rid in younger:
            over_total, over_tenant = over()
            if not (over_total or over_tenant):
                break
            if over_total or self.holds[rid].tenant == name:
                remove(self.holds[rid])
                dropped.append(rid)
        if any(over()):
            return False
        for rid in dropped:
            self._drop(rid)
            self.stats.retention_released += 1
        return True

    def release(self, rid: str) -> bool:
        """End the hold of request `rid` early; False when it has none."""
        if rid not in self.holds:
            return False
        self._drop(rid)
        return True

    def on_blocks_short(self, num_blocks: int, req: Request | None) -> None:
        self.reclaim(num_blocks, req)

    def on_kv_lost(self, on_lost_path: Callable[[Any], bool]) -> None:
        """A hold whose path lost its KV goes (its context would be recomputed anyway)."""
        for rid, hold in list(self.holds.items()):
            if on_lost_path(hold.handle):
                self.release(rid)

    def reclaim(self, num_blocks: int, req: Request | None = None) -> None:
        """The pool is short of `num_blocks` with nothing else evictable: give up holds, the
        youngest lineage first, until that many blocks could be evicted (or none may go).
        `req`: the request the blocks are for; a waiting one, while others run, takes only
        holds of lineages younger than its own (see the module docstring)."""
        limit = -1
        if req is not None and req.status is RequestStatus.WAITING and self.queues.running:
            limit = self.lineage(req)
        cache = self.kv.cache
        for rid in sorted(self.holds, key=lambda r: -self.holds[r].born):
            if cache.evictable_blocks >= num_blocks or self.holds[rid].born <= limit:
                break
            self._drop(rid)
            self.stats.retention_released += 1

    def lineage(self, req: Request) -> float:
        """The age of the oldest hold `req` continues (its sequence extends the held one),
        math.inf when it continues none (a new lineage: the youngest)."""
        tokens = req.seq_token_ids
        return min(
            (h.born for h in self.holds.values() if _extends(tokens, req.cache_namespace, h)),
            default=math.inf,
        )

    def _drop(self, rid: str) -> None:
        hold = self.holds.pop(rid)
        self._count(hold, -1)
        self.kv.cache.unlock(hold.handle)

    def _count(self, hold: Hold, sign: int) -> None:
        counters = [self._held]
        if hold.tenant is not None:
            counters.append(self._held_by_tenant.setdefault(hold.tenant, Counter()))
        for counter in counters:
            if sign > 0:
                counter.update(hold.blocks)
            else:
                counter.subtract(hold.blocks)
                for b in hold.blocks:
                    if counter[b] <= 0:
                        del counter[b]
        if hold.tenant is not None and not counters[1]:
            del self._held_by_tenant[hold.tenant]
            del self._tenant_limit[hold.tenant]

    def check_integrity(self) -> None:
        expected: Counter[int] = Counter()
        for h in self.holds.values():
            expected.update(h.blocks)
            assert sorted(h.blocks) == sorted(self.kv.cache.locked_blocks(h.handle)), h
        assert expected == self._held
        assert self.num_held_blocks <= self.max_blocks
        assert self._held_by_tenant.keys() == self._tenant_limit.keys()
        for name, limit in self._tenant_limit.items():
            assert self.num_tenant_held_blocks(name) <= limit, name


def _extends(tokens: list[int], namespace: CacheNamespace, hold: Hold) -> bool:
    """Whether the sequence `tokens` of cache namespace `namespace` continues `hold`'s
    sequence."""
    n = len(hold.tokens)
    return hold.namespace == namespace and len(tokens) >= n and tokens[:n] == hold.tokens
