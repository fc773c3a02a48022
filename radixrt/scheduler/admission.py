"""Admission: waiting requests into running ones (plain Python).

Each step, after decode rows and continuing chunks, the rest of the token budget admits
waiting requests in policy order (`radixrt.scheduler.policy`): match the cached prefix (once
per step and cache version), lock it, take its blocks (a partial last block copied, or
written on in place when nothing else can see past it), load host-resident blocks (host KV
tier), reserve the first chunk. A request that cannot fit holds nothing afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

from radixrt.cache.base import MatchResult
from radixrt.config import SchedulerConfig, holds_back_shared_prefixes
from radixrt.plan import BlockOp
from radixrt.scheduler.kv_manager import KVManager
from radixrt.scheduler.lifecycle import Lifecycle
from radixrt.scheduler.policy import IN_BATCH_PREFIX_THRESHOLD, order_waiting, share_prefix
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Request
from radixrt.scheduler.rows import chunk_len
from radixrt.stats import SchedulerCounters

# Scanning the waiting queue past this many held-back requests stops for the step (each
# check costs a prefix match).
MAX_DEFERRED_PER_STEP = 64


class Admission:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVManager,
        queues: RequestQueues,
        lifecycle: Lifecycle,
        stats: SchedulerCounters,
        admissible: list[Callable[[Request], bool]],
        clock: Callable[[], float],
    ) -> None:
        """`admissible`: the features' vetoes (a request any of them refuses waits); `clock`:
        seconds (the wait bound, `priority_max_wait_s`)."""
        self.cfg = cfg
        self.clock = clock
        self.kv = kv
        self.queues = queues
        self.lifecycle = lifecycle
        self.stats = stats
        self.admissible = admissible
        # This step's prefix matches of waiting requests (valid while cache.version holds).
        self._matches: dict[Request, MatchResult] = {}
        self._matches_version = -1

    def new_step(self) -> None:
        """Forget the last step's matches (a request is matched once per step)."""
        self._matches.clear()

    def match(self, req: Request) -> MatchResult:
        """The request's cached prefix this step: matched once, again only if the cache
        evicted something since (which may invalidate the earlier result)."""
        cache = self.kv.cache
        if self._matches_version != cache.version:
            self._matches.clear()
            self._matches_version = cache.version
        m = self._matches.get(req)
        if m is None:
            m = cache.match(req.seq_token_ids[: _match_limit(req)], req.cache_namespace)
            self._matches[req] = m
        return m

    def admit(self, budget: int, extend: list[tuple[Request, int]], ops: list[BlockOp]) -> int:
        """Admit waiting requests in policy order while the token budget, the running limit
        and the slots allow; each admitted request's first chunk goes to `extend`. Returns
        the budget left."""
        cfg, q, kv, stats = self.cfg, self.queues, self.kv, self.stats
        order = order_waiting(
            q.waiting,
            cfg.policy,
            self.match,
            cfg.aging_tokens_per_step,
            cfg.priority_aging_steps,
            self._overdue(),
        )
        # Cache-aware policies with a prefix cache hold back a request whose uncached prefix
        # another request is computing right now: once that result is in, it finds the
        # prefix in the cache. A prompt computes until its last chunk's result is applied
        # (that inserts it in the tree), not until that chunk is planned: with overlap the
        # next step is planned while the chunk runs, and a request let in then would compute
        # the prefix again.
        computing = [r for r in q.running if r.num_kv_done < r.prompt_len]
        dedup = holds_back_shared_prefixes(cfg.policy, kv.cache.mode)
        skipped = 0
        for req in order:
            if budget <= 0 or len(q.running) >= cfg.max_running_requests:
                break
            group_slots = req.group.num_slots if req.group is not None else 1
            if group_slots > kv.num_free_slots:
                break
            if not all(ok(req) for ok in self.admissible):
                continue
            if dedup and computing and self._shares_uncached_prefix(req, computing):
                skipped += 1
                if skipped >= MAX_DEFERRED_PER_STEP:
                    break
                continue
            num_ops = len(ops)
            try:
                n = self._try_start(req, ops, budget)
            except Exception as e:  # a bug starting one request fails that request only
                del ops[num_ops:]
                self.lifecycle.fail_outside_update(req, e)
                continue
            if n is None:
                break
            if req.group is not None:
                req.group.reserved_slots = [kv.take_slot() for _ in range(group_slots - 1)]
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed
                stats.host_hit_tokens += req.num_host_cached_tokens
                # a group's parent holds the prompt but its last token
                prompt_len = req.prompt_len + (1 if req.group is not None else 0)
                stats.num_requests += 1
                stats.prompt_tokens += prompt_len
                stats.cached_tokens += req.num_computed
                kv.cache.stats.record_lookup(prompt_len, req.num_computed)
            q.admit(req)
            if n == 0:  # a fork parent with its whole prefix cached
                req.group.ready = True
                continue
            if req.num_host_cached_tokens and (extend or budget < cfg.max_num_batched_tokens):
                # Its blocks load from the host tier in this step (SwapIn ops): its first row
                # comes with the next plan, so this step's other rows need not wait for the
                # transfer (see radixrt.kv.host_pool).
                stats.host_deferred_loads += 1
                continue
            extend.append((req, n))
            computing.append(req)
            budget -= n
        return budget

    def _overdue(self) -> Callable[[Request], bool] | None:
        """Whether a request has waited `priority_max_wait_s` or longer (None: no bound)."""
        if self.cfg.priority_max_wait_s <= 0:
            return None
        since = self.clock() - self.cfg.priority_max_wait_s
        return lambda req: req.queued_at <= since

    def _try_start(self, req: Request, ops: list[BlockOp], budget: int) -> int | None:
        """Start `req` and reserve its first chunk; returns the chunk, or None holding nothing.
        When nothing else runs and its locked cached path (with the blocks of every branch on
        it, which a host tier keeps and loads) leaves too few blocks, retry with shorter
        cached prefixes (the cache's boundaries on the path, then none): otherwise the
        request could never run."""
        kv = self.kv
        shorter: list[int] | None = None
        while True:
            if kv.start(req, self.match(req), ops):
                n = chunk_len(req, budget, self.cfg)
                if kv.reserve(req, n) and (not shorter or kv.can_finish(req)):
                    return n
                kv.release(req)  # drops its copy-on-write op too
            if self.queues.running:
                return None
            if shorter is None:
                m = self.match(req)
                if m.num_cached_tokens == 0:
                    return None
                bounds = {0, *kv.cache.prefix_boundaries(m.handle)}
                shorter = sorted(bounds - {m.num_cached_tokens})
            if not shorter:
                return None
            self.match(req)  # brings the per-step match table up to the cache version
            self._matches[req] = kv.cache.match(
                req.seq_token_ids[: shorter.pop()], req.cache_namespace
            )

    def _shares_uncached_prefix(self, req: Request, computing: list[Request]) -> bool:
        """Whether a request of the same cache namespace computes at least
        IN_BATCH_PREFIX_THRESHOLD tokens of `req`'s uncached prefix (another namespace's never
        lands in `req`'s part of the cache)."""
        end = self.match(req).num_cached_tokens + IN_BATCH_PREFIX_THRESHOLD
        seq, namespace = req.seq_token_ids, req.cache_namespace
        return any(
            share_prefix(seq, other.seq_token_ids, end) and other.cache_namespace == namespace
            for other in computing
        )


def _match_limit(req: Request) -> int:
    # The last token is always recomputed (its logits are sampled), but by a fork parent (it
    # samples nothing); with prompt log-probs, so is every token from logprob_start_len - 1 on.
    limit = len(req.seq_token_ids) - (0 if req.group is not None else 1)
    if req.params.prompt_logprobs:
        limit = min(limit, req.params.logprob_start_len - 1)
    return limit
