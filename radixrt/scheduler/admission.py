"""Admission: waiting requests into running ones (a mixin of `Scheduler`; plain Python).

Each step, after decode rows and continuing chunks, the rest of the token budget admits
waiting requests in policy order (`radixrt.scheduler.policy`): match the cached prefix (once
per step and cache version), lock it, take its blocks (a partial last block copied, or
written on in place when nothing else can see past it), load host-resident blocks (host KV
tier), reserve the first chunk. A request that cannot fit holds nothing afterwards.
"""

from __future__ import annotations

import math

from radixrt.cache.base import MatchResult
from radixrt.plan import CopyBlock
from radixrt.scheduler.policy import IN_BATCH_PREFIX_THRESHOLD, common_prefix_len, order_waiting
from radixrt.scheduler.request import Request, Status

# Scanning the waiting queue past this many held-back requests stops for the step (each
# check costs a prefix match).
MAX_DEFERRED_PER_STEP = 64


class Admission:
    """Mixin: needs the Scheduler's cfg, cache, allocator, waiting, running, stats, slots,
    _matches, _chunk, _reserve, _allocate, _release."""

    def _match(self, req: Request) -> MatchResult:
        """The request's cached prefix this step: matched once, again only if the cache
        evicted something since (which may invalidate the earlier result)."""
        if self._matches_version != self.cache.version:
            self._matches.clear()
            self._matches_version = self.cache.version
        m = self._matches.get(req)
        if m is None:
            m = self._matches[req] = self.cache.match(req.seq_token_ids[: self._match_limit(req)])
        return m

    @staticmethod
    def _match_limit(req: Request) -> int:
        # The last token is always recomputed (its logits are sampled), but by a fork
        # parent (it samples nothing); with prompt log-probs, so is every token from
        # logprob_start_len - 1 on.
        limit = len(req.seq_token_ids) - (0 if req.group is not None else 1)
        if req.params.prompt_logprobs:
            limit = min(limit, req.params.logprob_start_len - 1)
        return limit

    def _admit(self, budget: int, extend: list[tuple[Request, int]], ops: list) -> int:
        order = order_waiting(
            self.waiting, self.cfg.policy, self._match, self.cfg.aging_tokens_per_step
        )
        # Cache-aware policies hold back a request whose uncached prefix another request is
        # computing right now: once that result is in, it finds the prefix in the cache. A
        # prompt computes until its last chunk's result is applied (that inserts it in the
        # tree), not until that chunk is planned: with overlap the next step is planned
        # while the chunk runs, and a request let in then would compute the prefix again.
        computing = [r for r in self.running if r.num_kv_done < r.prompt_len]
        dedup = self.cfg.policy != "fcfs"
        skipped = 0
        for req in order:
            if budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
                break
            group_slots = req.group.num_slots if req.group is not None else 1
            if group_slots > len(self._free_slots):
                break
            if req.grammar_ticket is not None:  # grammar-pending: its compile runs
                continue
            if dedup and computing and self._shares_uncached_prefix(req, computing):
                skipped += 1
                if skipped >= MAX_DEFERRED_PER_STEP:
                    break
                continue
            n = self._try_start(req, ops, budget)
            if n is None:
                break
            if req.group is not None:
                req.group.reserved_slots = [self._free_slots.pop() for _ in range(group_slots - 1)]
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed
                self.stats.num_host_hit_tokens += req.num_host_cached_tokens
                # a group's parent holds the prompt but its last token
                prompt_len = req.prompt_len + (1 if req.group is not None else 0)
                self.stats.num_requests += 1
                self.stats.num_prompt_tokens += prompt_len
                self.stats.num_cached_tokens += req.num_computed
                self.cache.stats.record_lookup(prompt_len, req.num_computed)
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self._admissions += 1
            req.admission_seq = self._admissions
            self.running.append(req)
            if n == 0:  # a fork parent with its whole prefix cached
                req.group.ready = True
                continue
            if req.num_host_cached_tokens and (extend or budget < self.cfg.max_num_batched_tokens):
                # Its blocks load from the host tier in this step (SwapIn ops): its first row
                # comes with the next plan, so this step's other rows need not wait for the
                # transfer (see radixrt.kv.host_pool).
                self.stats.num_deferred_loads += 1
                continue
            extend.append((req, n))
            computing.append(req)
            budget -= n
        return budget

    def _try_start(self, req: Request, ops: list, budget: int) -> int | None:
        """Start `req` and reserve its first chunk; returns the chunk, or None holding nothing.
        When nothing else runs and its locked cached path (with the blocks of every branch on
        it, which a host tier keeps and loads) leaves too few blocks, retry with shorter
        cached prefixes (the path's node boundaries, then none): otherwise the request could
        never run."""
        shorter: list[int] | None = None
        while True:
            if self._start(req, ops):
                n = self._chunk(req, budget)
                if self._reserve(req, n) and (not shorter or self._can_finish(req)):
                    return n
                self._release(req)  # drops its copy-on-write op too
            if self.running:
                return None
            if shorter is None:
                m = self._match(req)
                if m.num_cached_tokens == 0:
                    return None
                node, shorter = m.handle, [0]
                while getattr(node, "parent", None) is not None:  # radix: node boundaries
                    shorter.insert(1, node.start)
                    node = node.parent
                shorter = sorted(set(shorter) - {m.num_cached_tokens})
            if not shorter:
                return None
            self._match(req)  # brings the per-step match table up to the cache version
            self._matches[req] = self.cache.match(req.seq_token_ids[: shorter.pop()])

    def _can_finish(self, req: Request) -> bool:
        """Whether the blocks free or evictable now cover the rest of `req` (all its tokens to
        come), so that a retry with a shorter prefix does not just preempt it again."""
        total = math.ceil(
            (len(req.seq_token_ids) + req.max_tokens - req.num_output) / self.block_size
        )
        return self.allocator.num_free + self.cache.evictable_blocks >= total - len(req.block_table)

    def _shares_uncached_prefix(self, req: Request, computing: list[Request]) -> bool:
        cached = self._match(req).num_cached_tokens
        return any(
            common_prefix_len(req.seq_token_ids, other.seq_token_ids) - cached
            >= IN_BATCH_PREFIX_THRESHOLD
            for other in computing
        )

    def _start(self, req: Request, ops: list) -> bool:
        """Lock the cached prefix and take its blocks (a partial last block is written on in
        place when nothing else can see past its matched tokens, else copied: a CopyBlock
        op). Returns False, holding nothing, when blocks are short."""
        bs = self.block_size
        m = self._match(req)
        self.cache.lock(m.handle)
        req.cache_handle = m.handle
        req.slot = self._free_slots.pop()
        req.num_host_cached_tokens = m.num_host_tokens
        if m.num_host_tokens:  # host tier: load the host-resident tail of the match
            table = self.cache.load(m.handle)
            if table is None:
                self._release(req)
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
                self.stats.num_inplace_appends += 1
            else:
                copy = self._allocate(1)
                if copy is None:
                    self._release(req)
                    return False
                ops.append(CopyBlock(last, copy[0], partial))
                self.stats.num_cow_copies += 1
                req.block_table += copy
        req.num_computed = req.num_kv_done = m.num_cached_tokens
        return True
