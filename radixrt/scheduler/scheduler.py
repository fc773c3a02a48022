"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

One step: `plan = scheduler.schedule()`, a runner executes it, `scheduler.update(plan,
result)`. The scheduler is plain Python: it holds no tensors and never touches KV memory;
copy-on-write is a block operation in the plan. Decode rows are scheduled first (one
token each); the rest of the token budget goes to prefill chunks, continuing ones first,
then waiting requests in policy order.

Overlap: `schedule()` may run while earlier plans are still executing (their results not
applied). A row sampled by a step in flight counts as one more token (`num_inflight_samples`)
whose value the next decode step reads on the device; stop conditions are checked when the
result arrives, and a request found finished then has the extra step's token dropped. A request
that is aborted, finished or preempted while in flight frees its KV at once; results of that
step for it are ignored. Freed blocks are reused only by later plans, which a runner executes
after the earlier ones (one stream), so no step reads a block after another reused it.

Speculation (`proposer`, see `radixrt.speculative`): a decode row with k drafts reserves blocks for
k + 1 tokens and samples at each; `update` appends the accepted tokens (stopping at a stop
condition inside them), rolls num_computed back to the accepted length and frees blocks past
it in the same step, so only accepted tokens ever reach the prefix cache. Such rows wait for
their result on the host (the proposer reads the sequence), so they do not overlap.
Structured output (`grammar_backend`): constrained requests wait while their grammar compiles,
their rows carry token bitmasks and wait for their result on the host; tokens the grammar
forces are appended without sampling (jump-forward); see `radixrt.scheduler.grammar`.
Groups (n > 1 children, beam search) share a prompt's blocks by reference and are admitted
(with all their slots), preempted and aborted as a whole; see `radixrt.scheduler.groups`.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from radixrt.cache.base import MatchResult, PrefixCache
from radixrt.config import SchedulerConfig
from radixrt.kv.allocator import BlockAllocator
from radixrt.plan import (
    CopyBlock,
    StepPlan,
    SwapIn,
    SwapOut,
)
from radixrt.scheduler.admission import Admission
from radixrt.scheduler.grammar import GrammarScheduling
from radixrt.scheduler.groups import GroupScheduling
from radixrt.scheduler.request import FinishReason, Request, Status
from radixrt.scheduler.results import ResultApplication
from radixrt.scheduler.rows import RowPlanning
from radixrt.scheduler.stats import SchedulerStats
from radixrt.speculative.base import Proposer

logger = logging.getLogger(__name__)


@dataclass
class _Launched:
    """Scheduler-side record of a plan in flight: which request (and incarnation) each row
    belongs to."""

    requests: list[Request]
    epochs: list[int]
    block_ops: list  # the plan's (a failed earlier plan may have left them wrong inputs)


class Scheduler(Admission, RowPlanning, GroupScheduling, GrammarScheduling, ResultApplication):
    def __init__(
        self,
        cfg: SchedulerConfig,
        allocator: BlockAllocator,
        cache: PrefixCache,
        *,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        proposer: Proposer | None = None,
        grammar_backend: object | None = None,
        jump_forward: bool = True,
        jump_forward_retokenize: bool = False,
    ) -> None:
        """`proposer` (speculative decoding) drafts tokens for decode rows; a row with
        drafts feeds its last token plus the drafts and samples at each (k + 1 tokens), and
        waits for that result on the host before its next step. `grammar_backend`
        (radixrt.grammar.base.GrammarBackend) serves constrained requests, with
        `jump_forward` and `jump_forward_retokenize` (see radixrt.scheduler.grammar)."""
        self.cfg = cfg
        self.grammar_backend = grammar_backend
        self.jump_forward = jump_forward
        self.jump_forward_retokenize = jump_forward_retokenize
        self._finished_outside_update: list[Request] = []
        self.proposer = proposer
        self.allocator = allocator
        self.cache = cache
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Runner row slots: one per running request (max_running_requests of them).
        self.num_slots = cfg.max_running_requests
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self.stats = SchedulerStats()
        self._admissions = 0
        self._step_ids = itertools.count()
        self._launched: dict[int, _Launched] = {}
        # This step's prefix matches of waiting requests (valid while cache.version holds).
        self._matches: dict[Request, MatchResult] = {}
        self._matches_version = -1
        # Block ops made while applying a result (beam re-parenting) for the next plan.
        self._pending_ops: list = []
        # Swap ops the cache queued (host KV tier; only the radix cache has one).
        self._take_swap_ops = getattr(cache, "take_swap_ops", list)

    # ---- requests in and out ----
    def add_request(self, req: Request) -> None:
        """Queue a request. Raises ValueError when it can never fit."""
        self._check_fits(req, 1, "")
        self._submit_grammar(req)
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Stop a request now (client gone, or a stop string seen: reason STOP) and free
        its KV; computed tokens stay in the prefix cache. Safe while a step holding the
        request is in flight (its results for the request are dropped). Returns the
        finished request, or None if `rid` is unknown or already finished."""
        req = self.requests.get(rid)
        if req is None:
            return None
        g = req.group
        if g is not None and req is g.parent:
            # the whole group: every child (an n > 1 parent finishes with its last child)
            for child in list(g.children):
                self._stop(child, reason)
            if req.status is not Status.FINISHED:
                self._stop(req, reason)
            return req
        self._stop(req, reason)
        return req

    def _stop(self, req: Request, reason: FinishReason) -> None:
        if req.status is Status.WAITING:
            if _queued(req):
                self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
        self._finish(req, reason)

    @property
    def has_work(self) -> bool:
        """Requests waiting or running (results of steps in flight may still be due)."""
        return bool(self.waiting or self.running)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._launched)

    # ---- scheduling ----
    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when no row can run now. Mutates request and cache
        state (blocks, locks, slots); the plan counts as in flight until `update`."""
        self._matches.clear()
        # The step's block ops so far: the same list as `_pending_ops` until the plan takes
        # it, so that `_free` drops the copies into blocks freed while planning.
        ops: list = self._pending_ops
        if self.grammar_backend is not None:
            self._poll_grammars()
        for parent in [r for r in self.running if r.group is not None and r.group.ready]:
            assert parent is parent.group.parent
            self._fork(parent.group, ops)
        decode = self._schedule_decode()
        budget = self.cfg.max_num_batched_tokens - sum(1 + len(d) for _, d in decode)
        extend: list[tuple[Request, int]] = []
        for req in [r for r in self.running if self._schedulable(r) and self._extend_due(r)]:
            n = self._chunk(req, budget)
            if n == 0 or req.status is not Status.RUNNING:
                break
            if not self._reserve(req, n) and not (
                not decode and not extend and self._preempt_until_reserved(req, n)
            ):
                break
            extend.append((req, n))
            budget -= n
        if budget > 0 and self.waiting:
            budget = self._admit(budget, extend, ops)
        for req in self.waiting:
            req.waited_steps += 1
        if not decode and not extend:
            # No row: the ops wait for the next plan (copies into blocks freed since went).
            self._pending_ops = self._swaps_first(ops)
            return None
        step_id = next(self._step_ids)
        # one-token rows first (the decode kernel), then rows with drafts, then prefill chunks
        ordered = [(r, d) for r, d in decode if not d] + [(r, d) for r, d in decode if d]
        if self.grammar_backend is not None:
            self._fill_masks([r for r, _ in decode] + [r for r, _ in extend])
        rows, reqs, failed = [], [], False
        for req, n, drafts in [(r, 1 + len(d), d) for r, d in ordered] + [
            (r, n, ()) for r, n in extend
        ]:
            try:
                rows.append(self._plan_row(req, n, drafts))
            except Exception as e:  # a bug planning one request fails that request only
                self._finished_outside_update += self._fail(req, e)
                failed = True
                continue
            reqs.append(req)
        if failed:  # rows of a failed group's other members go too
            kept = [i for i, r in enumerate(reqs) if r.status is Status.RUNNING]
            rows, reqs = [rows[i] for i in kept], [reqs[i] for i in kept]
        if not rows:
            self._pending_ops = self._swaps_first(ops)
            return None
        ops = self._swaps_first(ops)
        self._pending_ops = []
        self._launched[step_id] = _Launched(reqs, [r.epoch for r in reqs], ops)
        self.stats.num_steps += 1
        return StepPlan(step_id, rows, ops)

    def _swaps_first(self, ops: list) -> list:
        """`ops` with the host tier's swap ops (earlier pending ones, then those the cache
        made since) first, then the copies. Swaps never touch a copy's blocks (a copy reads
        a block its request holds and writes a fresh one it holds; `_free` drops a copy whose
        target was freed before its plan went out), so running them first is safe, and the
        runner can start every transfer before the step's device work."""
        swaps = [op for op in ops if _is_swap(op)] + self._take_swap_ops()
        return swaps + [op for op in ops if not _is_swap(op)]

    def _preempt_until_reserved(self, req: Request, n: int) -> bool:
        """Nothing else runs this step and `req` (a running request with a chunk to feed,
        e.g. a jump-forward run) lacks blocks: preempt the newest other requests until it
        has them, so that running chunks cannot all wait on each other's blocks. False when
        `req` itself went (its group was the newest) or nothing else can go."""
        while not self._reserve(req, n):
            if len(self.running) < 2:
                return False
            self._preempt(self._newest_preemptible(exclude=[req]))
            if req.status is not Status.RUNNING:
                return False
        return True

    def _newest_preemptible(self, exclude: list[Request]) -> Request:
        taken = set(map(id, exclude))
        candidates = [r for r in self.running if id(r) not in taken]
        assert candidates, "a request needing a block is always preemptible itself"
        return max(candidates, key=lambda r: r.admission_seq)

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
        req.block_table += blocks
        return True

    def _release(self, req: Request) -> None:
        """Give back the request's blocks, lock and slot; forget in-flight samples."""
        if req.cache_handle is not None:
            self.cache.unlock(req.cache_handle)
            req.cache_handle = None
        self._free(req.block_table)
        req.block_table = []
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None
        g = req.group
        if g is not None and req is g.parent:
            self._free_slots += g.reserved_slots
            g.reserved_slots = []
        req.num_computed = req.num_kv_done = req.num_table_sent = 0
        req.num_inflight_samples = 0
        req.awaiting_host_result = False

    def _free(self, blocks: list[int]) -> None:
        """Drop a request's reference on each of `blocks`. A copy queued for the next plan
        into a block that becomes free goes too: the block may be reused before that plan
        runs, e.g. as a host load's target, and the plan runs swap-ins before copies."""
        self.allocator.decref(blocks)
        freed = {b for b in blocks if self.allocator.ref_counts[b] == 0}
        if not freed:
            return
        self._pending_ops[:] = [op for op in self._pending_ops if not _copies_into(op, freed)]

    def _preempt(self, req: Request) -> None:
        """Free the request's KV and put it at the head of the waiting queue (it will be
        recomputed, reusing whatever the prefix cache still holds). A group member takes its
        whole group: the children leave (holding nothing), the parent is requeued and forks
        them again once it recomputed the shared prefix."""
        g = req.group
        if g is not None:
            for child in g.children:
                if child.status is Status.RUNNING:
                    self._unrun(child)
                    child.beam_top_logprobs = None
            g.ready = False
            req = g.parent
        self._unrun(req)
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _unrun(self, seq: Request) -> None:
        """Preemption of one sequence: out of `running`, its KV freed, a new epoch (results of
        steps in flight for it are ignored), waiting again."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        self._release(seq)
        seq.epoch += 1
        seq.status = Status.WAITING
        seq.num_preemptions += 1


def _copies_into(op: object, blocks: set[int]) -> bool:
    return isinstance(op, CopyBlock) and op.dst in blocks


def _is_swap(op: object) -> bool:
    return isinstance(op, SwapIn | SwapOut)


def _queued(req: Request) -> bool:
    """Whether a WAITING request sits in the waiting queue (a group's children wait inside
    their group instead)."""
    return req.group is None or req is req.group.parent
