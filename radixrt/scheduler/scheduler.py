"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

One step: `plan = scheduler.schedule()`, a runner executes it, `scheduler.update(plan,
result)`. The scheduler is plain Python: it holds no tensors and never touches KV memory;
copy-on-write is a block operation in the plan. Decode rows are scheduled first (one
token each); the rest of the token budget goes to prefill chunks, continuing ones first,
then waiting requests in policy order.

The `Scheduler` holds the queues and composes objects that own their state and get their
collaborators in the constructor: `KVManager` (blocks, slots, the prefix cache, block ops),
`Lifecycle` (finish, stop, fail, preempt), `Admission` (policy order, prefix matches),
`RowPlanner` (decode rows, chunks, plan rows), `ResultApplier` (tokens, stops, rollback,
cache inserts) and `InFlight` (the plans not applied yet). Features are scheduler halves
called at named hooks (`radixrt.scheduler.features`): n > 1 / beam-search groups (`groups`),
structured output (`grammar`), retention hints (`retention`) and speculative decoding
(`speculation`). `schedule()` and `update()` below are the whole step.

Overlap and the plans in flight: see `radixrt.scheduler.steps`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from radixrt.cache.base import PrefixCache
from radixrt.cache.radix_storage import StorageRadixCache
from radixrt.config import SchedulerConfig
from radixrt.deltas import FinishReason
from radixrt.errors import RequestValueError
from radixrt.kv.allocator import BlockAllocator
from radixrt.limits import check_fits
from radixrt.plan import StepPlan, StepResult
from radixrt.sampling import DEFAULT_OPTIONS, BeamSearchParams, RequestOptions
from radixrt.scheduler.admission import Admission
from radixrt.scheduler.features import Hooks, SchedulerFeature, StepTables
from radixrt.scheduler.grammar import GrammarFeature, NoGrammar
from radixrt.scheduler.groups import GroupsFeature
from radixrt.scheduler.kv_manager import KVManager, is_swap
from radixrt.scheduler.lifecycle import Lifecycle
from radixrt.scheduler.lora import LoraFeature
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Request, RequestStatus
from radixrt.scheduler.results import ResultApplier
from radixrt.scheduler.retention import RetentionFeature
from radixrt.scheduler.rows import RowPlanner, chunk_len, extend_due, schedulable
from radixrt.scheduler.speculation import SpeculationFeature
from radixrt.scheduler.steps import InFlight, Launched, discard_unmade_copies
from radixrt.scheduler.storage import StorageFeature
from radixrt.speculative.base import Proposer, SpecStats
from radixrt.stats import SchedulerCounters
from radixrt.tenant import Tenant


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        allocator: BlockAllocator,
        cache: PrefixCache,
        *,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        proposer: Proposer | None = None,
        grammar_backend: Any = None,
        jump_forward: bool = True,
        jump_forward_retokenize: bool = False,
        max_graph_tokens: int = 0,
        overlap: bool = False,
        max_loras: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`proposer` (speculative decoding) drafts tokens for decode rows; `grammar_backend`
        (radixrt.grammar.base.GrammarBackend) serves constrained requests, with
        `jump_forward` and `jump_forward_retokenize` (see radixrt.scheduler.grammar).
        `max_graph_tokens`: the runner's largest decode CUDA graph (Runner.max_graph_tokens;
        0: none), which a decode step's drafts stay within; `overlap`: whether the loop
        overlaps steps (`overlap`, settable); `max_loras`: distinct LoRA adapters the running
        requests may use (0: LoRA off); `clock`: seconds, for how long requests wait."""
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.max_graph_tokens = max_graph_tokens
        self._overlap = overlap
        self.clock = clock
        eos = frozenset(eos_token_ids)
        self.stats = SchedulerCounters()  # mutated in place by the parts and features
        self.spec_stats = SpecStats()  # speculative decoding's (zero without a proposer)
        self.queues = RequestQueues()
        self.hooks = Hooks()  # the features' hooks, bound by _compose
        h = self.hooks
        self.kv = KVManager(
            allocator, cache, cfg.max_running_requests, self.stats, h.on_blocks_short
        )
        self.lifecycle = Lifecycle(self.kv, self.queues, self.stats, eos, max_model_len, h)
        self.groups = GroupsFeature(self.kv, self.queues, self.lifecycle, self.stats, eos)
        self.retention = RetentionFeature(cfg, self.kv, self.queues, self.stats, clock)
        self.lora = LoraFeature(max_loras, self.queues, self.stats) if max_loras else None
        self.admission = Admission(
            cfg, self.kv, self.queues, self.lifecycle, self.stats, h.admissible, clock
        )
        self.results = ResultApplier(
            self.kv, self.lifecycle, self.stats, h.on_row_result, h.on_token, h.after_update
        )
        self.inflight = InFlight()
        self.storage: StorageFeature | None = None  # the storage tier's (made by _compose)
        self._last_result_at = 0.0  # the clock when the latest step result was applied
        self._jump_forward = (jump_forward, jump_forward_retokenize)
        self._step_ids = itertools.count()  # of plans, over the scheduler's life
        self.grammar: GrammarFeature | None = None
        self.speculation: SpeculationFeature | None = None
        self.use_grammar_backend(grammar_backend)
        self.use_proposer(proposer)

    # ---- composition ----
    def use_grammar_backend(self, backend: Any, jump_forward: bool | None = None) -> None:
        """Serve structured output with `backend` (None: refuse constrained requests). Call
        before any request is added."""
        assert not self.queues.requests, "features are composed before requests arrive"
        if jump_forward is not None:
            self._jump_forward = (jump_forward, self._jump_forward[1])
        jf, retokenize = self._jump_forward
        self.grammar = (
            None
            if backend is None
            else GrammarFeature(
                backend,
                self.queues,
                self.lifecycle,
                self.stats,
                jump_forward=jf,
                jump_forward_retokenize=retokenize,
            )
        )
        self._compose()

    def use_proposer(self, proposer: Proposer | None) -> None:
        """Speculate with `proposer` (None: no speculative decoding). Call before any request
        is added."""
        assert not self.queues.requests, "features are composed before requests arrive"
        self.speculation = (
            None
            if proposer is None
            else SpeculationFeature(
                proposer,
                self.cfg,
                self.spec_stats,
                self.max_model_len,
                self.hooks,
                self.max_graph_tokens,
                self._overlap,
            )
        )
        self._compose()

    @property
    def overlap(self) -> bool:
        """Whether the engine loop overlaps steps (speculative decoding verifies only drafts
        worth a wait then)."""
        return self._overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self._overlap = on
        if self.speculation is not None:
            self.speculation.overlap = on

    def _compose(self) -> None:
        """Bind the features' hooks (the parts hold the hook lists) and make the row planner,
        whose drafter is speculative decoding."""
        grammar = self.grammar if self.grammar is not None else NoGrammar()
        features: list[SchedulerFeature] = [self.groups, grammar, self.retention]
        if isinstance(self.kv.cache, StorageRadixCache):
            if self.storage is None:
                self.storage = StorageFeature(self.kv.cache, self.clock)
            features.append(self.storage)
        if self.lora is not None:
            features.append(self.lora)
        if self.speculation is not None:
            features.append(self.speculation)
        self.hooks.bind(features)
        self.rows = RowPlanner(
            self.cfg,
            self.kv,
            self.queues,
            self.lifecycle,
            self.stats,
            self.max_model_len,
            self.hooks.on_row,
            self.speculation,
        )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that stop a request (unless it ignores EOS) and end a beam."""
        return self.lifecycle.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.lifecycle.eos_token_ids = self.groups.eos_token_ids = frozenset(ids)

    # ---- the queues (read-only use outside the scheduler) ----
    @property
    def requests(self) -> dict[str, Request]:
        return self.queues.requests

    @property
    def waiting(self):
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    @property
    def has_work(self) -> bool:
        """Requests waiting or running (results of steps in flight may still be due)."""
        return self.queues.has_work

    @property
    def num_inflight_steps(self) -> int:
        return len(self.inflight)

    def wants_result_first(self) -> bool:
        """Whether the loop should apply the in-flight steps' results before planning the
        next (speculative decoding's rule, see radixrt.scheduler.speculation): one has verify
        rows, which a plan made now would leave out (they would advance every other step), or
        rows in flight could draft, once their samples are known, enough for a step to verify
        them. Other rows that wait for their host result (grammar masks, beams) are left out
        of the overlapped plan instead."""
        if self.inflight.has_verify_rows:
            return True
        spec = self.speculation
        return spec is not None and spec.worth_waiting(
            [r for r in self.queues.running if r.status is RequestStatus.RUNNING]
        )

    # ---- requests in and out ----
    def add_request(self, req: Request) -> None:
        """Queue a request. Raises ValueError when it can never fit (nothing is queued)."""
        self._check_fits(req, 1, "")
        for hook in self.hooks.on_add:
            hook(req)
        req.queued_at = self.clock()
        self.queues.requests[req.rid] = req
        self.queues.waiting.append(req)

    def add_fork(self, req: Request) -> list[Request]:
        """Queue an n > 1 request (`req.params.n` children, see `GroupsFeature.fork_children`).
        Returns the children; the parent `req.rid` gets no outputs of its own. Raises
        ValueError when the n sequences can never fit."""
        self._check_fits(req, req.params.n, "n")
        children = self.groups.fork_children(req)
        parent = self.groups.make_group(req, children, None)
        for hook in self.hooks.on_add:  # the parent waits for its grammar; children get one
            hook(parent)
        parent.queued_at = self.clock()
        self.groups.add_group(parent)
        return children

    def add_beam_search(
        self,
        rid: str,
        prompt_ids: Sequence[int],
        params: BeamSearchParams,
        max_tokens: int,
        tenant: Tenant | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> Request:
        """Queue a beam search (`max_tokens` resolved against the context) of `tenant`. The
        returned request gets one output when the search ends: `group.beam.finished`, best
        first. Raises ValueError on bad input (nothing is queued)."""
        req, beam, state = self.groups.beam_search(
            rid, prompt_ids, params, max_tokens, tenant, options
        )
        self._check_fits(req, params.beam_width, "beam_width")
        parent = self.groups.make_group(req, [beam], state)
        parent.queued_at = self.clock()
        self.groups.add_group(parent)
        return req

    def _check_fits(self, req: Request, num_seqs: int, field_name: str) -> None:
        """RequestValueError when `req.rid` is in use or `num_seqs` sequences of `req` can
        never fit together (`radixrt.limits.check_fits`)."""
        if req.rid in self.queues.requests:
            raise RequestValueError(f"request id {req.rid!r} is already in use")
        kv = self.kv
        check_fits(
            req.prompt_len,
            req.max_tokens,
            num_seqs,
            field_name,
            num_slots=kv.num_slots,
            num_blocks=kv.allocator.num_blocks,
            block_size=kv.block_size,
            max_model_len=self.max_model_len,
        )

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Stop a request now (client gone, or a stop string seen: reason STOP) and free
        its KV; computed tokens stay in the prefix cache. Safe while a step holding the
        request is in flight (its results for the request are dropped). Returns the
        finished request, or None if `rid` is unknown or already finished."""
        return self.lifecycle.abort(rid, reason)

    def fail_request(self, req: Request, error: str) -> list[Request]:
        """Fail a live request now (a member of a group: the group), e.g. when its output
        cannot be reported. Returns the failed requests that report."""
        assert req.status is not RequestStatus.FINISHED
        return self.lifecycle.fail(req, error)

    def drain_finished(self) -> list[Request]:
        """Requests finished outside `update` (a grammar that failed to compile, a request
        that failed while being planned) since the last call: they need a last delta."""
        return self.lifecycle.drain_finished()

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block up to `timeout_s` until a pending compile finishes (at once when none is
        pending). For a loop whose step planned nothing."""
        if self.grammar is not None:
            self.grammar.wait(timeout_s)

    # ---- one step ----
    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when no row can run now: decode rows first (one token
        each, with drafts under speculative decoding), then continuing prefill chunks, then
        waiting requests in policy order. Mutates request and cache state (blocks, locks,
        slots); the plan counts as in flight until `update`."""
        kv = self.kv
        self.admission.new_step()
        ops = kv.step_ops()
        for hook in self.hooks.before_schedule:
            hook(ops)
        decode = self.rows.decode_rows()
        budget = self.cfg.max_num_batched_tokens - sum(1 + len(d) for _, d in decode)
        extend, budget = self._continue_prefills(budget, bool(decode))
        if budget > 0 and self.queues.waiting:
            budget = self.admission.admit(budget, extend, ops)
        for req in self.queues.waiting:
            req.waited_steps += 1
        if not decode and not extend:
            kv.keep_ops()  # no row: the ops wait (copies into blocks freed since went)
            return None
        for hook in self.hooks.before_rows:
            hook([r for r, _ in decode] + [r for r, _ in extend])
        tables = StepTables()
        computed = self.stats.prompt_tokens_computed
        rows, reqs = self._plan_rows(decode, extend, tables)
        computed = self.stats.prompt_tokens_computed - computed
        if not rows:
            kv.keep_ops()
            return None
        step_id = next(self._step_ids)
        ops = kv.launch_ops()
        verify = any(r.num_draft_tokens for r in rows)
        launched = Launched(reqs, [r.epoch for r in reqs], ops, verify, computed, self.clock())
        self.inflight.launch(step_id, launched)
        self.stats.steps += 1
        plan = StepPlan(step_id, rows, ops, new_slots=kv.entries.launch())
        tables.fill(plan)
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply an executed plan's result (plans are applied in the order they were
        made). Returns the requests that got tokens or finished."""
        launched = self.inflight.pop(plan.step_id)
        if self.storage is not None:
            # overlapped steps run one after another: a step's time starts at its launch or
            # at the previous result, whichever is later
            now = self.clock()
            start = max(launched.launched_at, self._last_result_at)
            self.storage.on_step(launched.prompt_tokens, now - start)
            self._last_result_at = now
        return self.results.apply(plan, result, launched.requests, launched.epochs)

    def fail_step(self, plan: StepPlan, error: str) -> list[Request]:
        """The plan's execution failed: finish every request still in it (same incarnation)
        with FinishReason.ERROR. With host-tier swap ops in it, none of its block ops counts as
        done (`discard_unmade_copies`). Returns the failed requests."""
        launched = self.inflight.pop(plan.step_id)
        self.stats.failed_steps += 1
        failed = []
        for req, epoch in zip(launched.requests, launched.epochs):
            if req.epoch == epoch and req.status is RequestStatus.RUNNING:
                failed += self.lifecycle.fail(req, error)
        if any(is_swap(op) for op in plan.block_ops):
            later = self.inflight.block_ops_after(plan.step_id)
            discard_unmade_copies(
                plan, later, self.kv, self.queues, self.lifecycle, self.hooks.on_kv_lost
            )
        return failed

    def _continue_prefills(
        self, budget: int, has_decode: bool
    ) -> tuple[list[tuple[Request, int]], int]:
        """Prefill chunks of running requests within `budget` tokens, in running order; the
        chunks and the budget left."""
        extend: list[tuple[Request, int]] = []
        for req in [r for r in self.queues.running if schedulable(r) and extend_due(r)]:
            n = chunk_len(req, budget, self.cfg)
            if n == 0 or req.status is not RequestStatus.RUNNING:
                break
            if not self.kv.reserve(req, n) and not (
                not has_decode and not extend and self._preempt_until_reserved(req, n)
            ):
                break
            extend.append((req, n))
            budget -= n
        return extend, budget

    def _preempt_until_reserved(self, req: Request, n: int) -> bool:
        """Nothing else runs this step and `req` (a running request with a chunk to feed,
        e.g. a jump-forward run) lacks blocks: preempt the newest other requests until it
        has them, so that running chunks cannot all wait on each other's blocks. False when
        `req` itself went (its group was the newest) or nothing else can go."""
        while not self.kv.reserve(req, n):
            if len(self.queues.running) < 2:
                return False
            self.lifecycle.preempt_newest(exclude=[req])
            if req.status is not RequestStatus.RUNNING:
                return False
        return True

    def _plan_rows(
        self,
        decode: list[tuple[Request, list[int]]],
        extend: list[tuple[Request, int]],
        tables: StepTables,
    ) -> tuple[list, list[Request]]:
        """The plan rows: one-token rows first (the decode kernel), then rows with drafts, then
        prefill chunks. A request whose row fails to plan fails (with its group), alone."""
        ordered = [(r, d) for r, d in decode if not d] + [(r, d) for r, d in decode if d]
        rows, reqs, failed = [], [], False
        for req, n, drafts in [(r, 1 + len(d), d) for r, d in ordered] + [
            (r, n, []) for r, n in extend
        ]:
            try:
                rows.append(self.rows.plan_row(req, n, drafts, tables))
            except Exception as e:  # a bug planning one request fails that request only
                self.lifecycle.fail_outside_update(req, e)
                failed = True
                continue
            reqs.append(req)
        if failed:  # rows of a failed group's other members go too
            kept = [i for i, r in enumerate(reqs) if r.status is RequestStatus.RUNNING]
            rows, reqs = [rows[i] for i in kept], [reqs[i] for i in kept]
        return rows, reqs

    # ---- integrity ----
    def check_integrity(self) -> None:
        """Every block reference, lock and slot is accounted for (see KVManager), groups and
        the features' own state are consistent."""
        q = self.queues
        idle, reserved = self.groups.idle_members()
        self.kv.check_integrity(q.running, list(q.waiting) + idle, reserved)
        for hook in self.hooks.check_integrity:
            hook()
