"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

One step: `batch = scheduler.schedule()`, the runner runs it, `scheduler.update(batch,
tokens)`. Decode rows are scheduled first (one token each); the rest of the token budget
goes to prefill chunks, continuing ones first, then waiting requests in policy order.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from radixrt.cache.base import PrefixCache
from radixrt.config import SchedulerConfig
from radixrt.kv.allocator import BlockAllocator
from radixrt.kv.pool import KVPool
from radixrt.scheduler.batch import BlockTableArray, ScheduledBatch, StepOutput
from radixrt.scheduler.policy import IN_BATCH_PREFIX_THRESHOLD, common_prefix_len, order_waiting
from radixrt.scheduler.request import Request, Status

# Scanning the waiting queue past this many held-back requests stops for the step (each
# check costs a prefix match).
MAX_DEFERRED_PER_STEP = 64


@dataclass
class SchedulerStats:
    num_requests: int = 0  # admitted for the first time
    num_prompt_tokens: int = 0  # prompt tokens of those
    num_cached_tokens: int = 0  # of those, served by the prefix cache
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_cow_copies: int = 0  # partial blocks copied on a mid-block match
    num_inplace_appends: int = 0  # mid-block matches that could write on in the cached block
    num_steps: int = 0
    finish_reasons: Counter = field(default_factory=Counter)

    @property
    def cache_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        allocator: BlockAllocator,
        cache: PrefixCache,
        pool: KVPool,
        *,
        max_model_len: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.cfg = cfg
        self.allocator = allocator
        self.cache = cache
        self.pool = pool
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.tables = BlockTableArray(
            cfg.max_running_requests, math.ceil(max_model_len / self.block_size)
        )
        self.stats = SchedulerStats()
        self._admissions = 0

    # ---- requests in and out ----
    def add_request(self, req: Request) -> None:
        """Queue a request. Raises ValueError when it can never fit."""
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        if req.prompt_len < 1:
            raise ValueError("prompt is empty: at least one token is needed")
        if req.prompt_len >= self.max_model_len:
            raise ValueError(
                f"prompt has {req.prompt_len} tokens; the context length is "
                f"{self.max_model_len}, so at most {self.max_model_len - 1} are allowed"
            )
        total = min(req.prompt_len + req.params.max_tokens, self.max_model_len)
        blocks = math.ceil(total / self.block_size)
        if blocks > self.allocator.num_blocks:
            raise ValueError(
                f"prompt + max_tokens need {blocks} KV blocks but the pool has only "
                f"{self.allocator.num_blocks}; shorten the prompt or lower max_tokens"
            )
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str, reason: str = "abort") -> Request | None:
        """Stop a request now (client gone, or a stop string seen: reason "stop") and free
        its KV; computed tokens stay in the prefix cache. Returns the finished request, or
        None if `rid` is unknown or already finished."""
        req = self.requests.get(rid)
        if req is None:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self._finish(req, reason)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ----
    def schedule(self) -> ScheduledBatch | None:
        """Pick this step's rows. Mutates request/cache state (blocks, locks)."""
        decode = self._schedule_decode()
        budget = self.cfg.max_num_batched_tokens - len(decode)
        extend: list[tuple[Request, int]] = []
        for req in [r for r in self.running if r.num_pending > 1]:
            n = self._chunk(req, budget)
            if n == 0 or not self._reserve(req, n):
                break
            extend.append((req, n))
            budget -= n
        if budget > 0 and self.waiting:
            budget = self._admit(budget, extend)
        for req in self.waiting:
            req.waited_steps += 1
        if not decode and not extend:
            return None
        self.stats.num_steps += 1
        rows = decode + [r for r, _ in extend]
        return ScheduledBatch(
            rows=rows,
            num_new=[1] * len(decode) + [n for _, n in extend],
            num_decode=len(decode),
            table_rows=np.fromiter((r.table_row for r in rows), dtype=np.int64, count=len(rows)),
        )

    def _schedule_decode(self) -> list[Request]:
        scheduled: list[Request] = []
        for req in sorted(self.running, key=lambda r: r.admission_seq):
            if req.status is not Status.RUNNING or req.num_pending != 1:
                continue
            while not self._reserve(req, 1):
                victim = self._newest_preemptible(exclude=scheduled)
                self._preempt(victim)
                if victim is req:
                    break
            else:
                scheduled.append(req)
        return scheduled

    def _newest_preemptible(self, exclude: list[Request]) -> Request:
        taken = set(map(id, exclude))
        candidates = [r for r in self.running if id(r) not in taken]
        assert candidates, "a request needing a block is always preemptible itself"
        return max(candidates, key=lambda r: r.admission_seq)

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_pending, budget)
        if self.cfg.long_prefill_token_threshold:
            n = min(n, self.cfg.long_prefill_token_threshold)
        return max(n, 0)

    def _admit(self, budget: int, extend: list[tuple[Request, int]]) -> int:
        order = order_waiting(
            self.waiting, self.cfg.policy, self.cache, self.cfg.aging_tokens_per_step
        )
        # Cache-aware policies hold back a request whose uncached prefix another request is
        # computing right now: next step it finds that prefix in the cache instead.
        computing = [r for r in self.running if r.num_pending > 1]
        dedup = self.cfg.policy != "fcfs"
        skipped = 0
        for req in order:
            if budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
                break
            if dedup and computing and self._shares_uncached_prefix(req, computing):
                skipped += 1
                if skipped >= MAX_DEFERRED_PER_STEP:
                    break
                continue
            if not self._start(req):
                break
            n = self._chunk(req, budget)
            if not self._reserve(req, n):
                self._release(req)
                break
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed
                self.stats.num_requests += 1
                self.stats.num_prompt_tokens += req.prompt_len
                self.stats.num_cached_tokens += req.num_computed
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self._admissions += 1
            req.admission_seq = self._admissions
            self.running.append(req)
            extend.append((req, n))
            computing.append(req)
            budget -= n
        return budget

    def _shares_uncached_prefix(self, req: Request, computing: list[Request]) -> bool:
        cached = self.cache.match(req.token_ids[:-1]).num_cached_tokens
        return any(
            common_prefix_len(req.token_ids, other.token_ids) - cached >= IN_BATCH_PREFIX_THRESHOLD
            for other in computing
        )

    def _start(self, req: Request) -> bool:
        """Match the cached prefix, lock it and take its blocks (copying a partial last
        block). Returns False, holding nothing, when blocks are short."""
        bs = self.block_size
        # The last token is always recomputed (its logits are sampled); with prompt
        # log-probs, so is every token from logprob_start_len - 1 on.
        limit = len(req.token_ids) - 1
        if req.params.prompt_logprobs:
            limit = min(limit, req.params.logprob_start_len - 1)
            req.prompt_logprobs = []
        m = self.cache.match(req.token_ids[:limit])
        self.cache.lock(m.handle)
        req.cache_handle = m.handle
        req.table_row = self.tables.acquire()
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
                self.pool.copy_prefix(last, copy[0], partial)
                self.stats.num_cow_copies += 1
                req.block_table += copy
        self.tables.write(req.table_row, 0, req.block_table)
        req.num_computed = m.num_cached_tokens
        return True

    def _allocate(self, n: int) -> list[int] | None:
        short = n - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
            if self.allocator.num_free < n:
                return None
        return self.allocator.allocate(n)

    def _reserve(self, req: Request, n: int) -> bool:
        """Make sure `req` has blocks for its next `n` tokens."""
        need = math.ceil((req.num_computed + n) / self.block_size) - len(req.block_table)
        if need <= 0:
            return True
        blocks = self._allocate(need)
        if blocks is None:
            return False
        self.tables.write(req.table_row, len(req.block_table), blocks)
        req.block_table += blocks
        return True

    def _release(self, req: Request) -> None:
        """Give back the request's blocks, lock and table row."""
        if req.cache_handle is not None:
            self.cache.unlock(req.cache_handle)
            req.cache_handle = None
        self.allocator.decref(req.block_table)
        req.block_table = []
        if req.table_row is not None:
            self.tables.release(req.table_row)
            req.table_row = None
        req.num_computed = 0

    def _preempt(self, req: Request) -> None:
        """Free the request's KV and put it at the head of the waiting queue (it will be
        recomputed, reusing whatever the prefix cache still holds)."""
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the forward ----
    def update(self, batch: ScheduledBatch, out: StepOutput) -> list[Request]:
        """Account the step: `out.tokens[i]` is row i's sampled token (ignored for rows
        that fed a non-final prefill chunk). Returns the rows that got a token."""
        changed: list[Request] = []
        next_tokens, logprobs = out.tokens, out.logprobs
        for i, prompt_lps in out.prompt_logprobs.items():
            batch.rows[i].prompt_logprobs += prompt_lps
        for i, (req, n) in enumerate(zip(batch.rows, batch.num_new)):
            req.num_computed += n
            if req.params.max_tokens == 0 and req.num_computed == len(req.token_ids):
                changed.append(req)  # prefill-only (scoring / cache warming): done
                self._finish_running(req, "length")
                continue
            if i >= batch.num_decode:  # prefill progress is shared with others at once
                self._cache_progress(req)
            if req.num_computed < len(req.token_ids):  # a prefill chunk; more to come
                continue
            changed.append(req)
            token = int(next_tokens[i])
            req.token_ids.append(token)
            if logprobs is not None and req.params.logprobs:
                req.output_logprobs.append(float(logprobs[i]))
            self.stats.num_generated_tokens += 1
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish_running(req, reason)
        return changed

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if req.num_output >= p.max_tokens or len(req.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _cache_progress(self, req: Request) -> None:
        """Insert a chunked prefill's computed tokens so others can share them."""
        result = self.cache.insert(req.token_ids[: req.num_computed], req.block_table)
        self.cache.lock(result.handle)
        self.cache.unlock(req.cache_handle)
        req.cache_handle = result.handle

    def _finish_running(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        if req.num_computed:
            self.cache.insert(req.token_ids[: req.num_computed], req.block_table)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.stats.finish_reasons[reason] += 1
        del self.requests[req.rid]

    # ---- integrity ----
    def check_integrity(self) -> None:
        """Every block reference is accounted for: the cache's plus the requests'."""
        refs = self.cache.held_refs()
        for req in self.running:
            refs.update(req.block_table)
            assert len(req.block_table) >= math.ceil(req.num_computed / self.block_size)
        for req in self.waiting:
            assert not req.block_table and req.cache_handle is None
        self.allocator.check_integrity(refs)
        self.cache.check_integrity()
        in_use = {b for r in self.running for b in r.block_table}
        cached_only = set(self.cache.held_refs()) - in_use
        assert len(cached_only) <= self.cache.cached_blocks
        free, num_in_use, num_cached = self.allocator.num_free, len(in_use), len(cached_only)
        assert free + num_cached + num_in_use == self.allocator.num_blocks, (
            f"free {free} + cached {num_cached} + in use {num_in_use} "
            f"!= total {self.allocator.num_blocks}"
        )
