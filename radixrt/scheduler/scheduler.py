"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

One step: `plan = scheduler.schedule()`, a runner executes it, `scheduler.update(plan,
result)`. The scheduler is plain Python: it holds no tensors and never touches KV memory;
copy-on-write is a block operation in the plan. Decode rows are scheduled first (one
token each); the rest of the token budget goes to prefill chunks, continuing ones first,
then waiting requests in policy order.

The `Scheduler` holds the queues and composes objects that own their state and get their
collaborators in the constructor: `KVManager` (blocks, slots, the prefix cache, block ops),
`Lifecycle` (finish, stop, fail, preempt), `Admission` (policy order, prefix matches),
`RowPlanner` (decode rows, chunks, plan rows) and `ResultApplier` (tokens, stops, rollback,
cache inserts). Features are scheduler halves called at named hooks
(`radixrt.scheduler.features`): n > 1 / beam-search groups (`groups`), structured output
(`grammar`) and speculative decoding (`speculation`).

Overlap: `schedule()` may run while earlier plans are still executing (their results not
applied). A row sampled by a step in flight counts as one more token (`num_inflight_samples`)
whose value the next decode step reads on the device; stop conditions are checked when the
result arrives, and a request found finished then has the extra step's token dropped. A request
that is aborted, finished or preempted while in flight frees its KV at once; results of that
step for it are ignored. Freed blocks and slots are reused only by later plans, which a runner
executes after the earlier ones (one stream), so no step reads a block after another reused it
and a slot's new entry lands after the old step's device updates. Rows that need their result
on the host before the next plan (verify rows, grammar masks, beams) are not planned again
until it arrives; penalised rows do not wait (the runner counts their samples per slot).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixrt.cache.base import PrefixCache
from radixrt.cache.tiers import unmade_blocks
from radixrt.config import SchedulerConfig
from radixrt.errors import RequestValueError
from radixrt.kv.allocator import BlockAllocator
from radixrt.limits import group_blocks_needed
from radixrt.plan import BlockOp, StepPlan, StepResult
from radixrt.sampling import BeamSearchParams
from radixrt.scheduler.admission import Admission
from radixrt.scheduler.features import Hooks, SchedulerFeature, StepTables
from radixrt.scheduler.grammar import GrammarFeature, NoGrammar
from radixrt.scheduler.groups import GroupsFeature
from radixrt.scheduler.kv_manager import KVManager, is_swap
from radixrt.scheduler.lifecycle import Lifecycle
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import FinishReason, Request, Status
from radixrt.scheduler.results import ResultApplier
from radixrt.scheduler.retention import RetentionFeature
from radixrt.scheduler.rows import RowPlanner, chunk_len, extend_due, schedulable
from radixrt.scheduler.speculation import SpeculationFeature
from radixrt.speculative.base import Proposer, SpecStats
from radixrt.stats import SchedulerCounters


@dataclass
class _Launched:
    """Scheduler-side record of a plan in flight: which request (and incarnation) each row
    belongs to."""

    requests: list[Request]
    epochs: list[int]
    block_ops: list[BlockOp]  # the plan's (a failed earlier plan may have left them wrong inputs)
    has_verify_rows: bool  # rows with drafts (their next row starts where acceptance ends)


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
    ) -> None:
        """`proposer` (speculative decoding) drafts tokens for decode rows; `grammar_backend`
        (radixrt.grammar.base.GrammarBackend) serves constrained requests, with
        `jump_forward` and `jump_forward_retokenize` (see radixrt.scheduler.grammar)."""
        self.cfg = cfg
        self.max_model_len = max_model_len
        eos = frozenset(eos_token_ids)
        self.stats = SchedulerCounters()  # mutated in place by the parts and features
        self.spec_stats = SpecStats()  # speculative decoding's (zero without a proposer)
        self.queues = RequestQueues()
        self.kv = KVManager(allocator, cache, cfg.max_running_requests, self.stats)
        self.lifecycle = Lifecycle(self.kv, self.queues, self.stats, eos, max_model_len)
        self.groups = GroupsFeature(self.kv, self.queues, self.lifecycle, self.stats, eos)
        self.retention = RetentionFeature(cfg, self.kv, self.stats)
        self._jump_forward = (jump_forward, jump_forward_retokenize)
        self._step_ids = itertools.count()
        self._launched: dict[int, _Launched] = {}
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
                proposer, self.cfg, self.spec_stats, self.max_model_len, self.grammar
            )
        )
        self._compose()

    def _compose(self) -> None:
        """Wire the features' hooks into the admission, planning and result halves."""
        grammar = self.grammar if self.grammar is not None else NoGrammar()
        if self.speculation is not None:
            self.speculation.grammar = self.grammar
        features: list[SchedulerFeature] = [self.groups, grammar, self.retention]
        if self.speculation is not None:
            features.append(self.speculation)
        self.hooks = hooks = Hooks(features)
        self.lifecycle.on_preempt = hooks.on_preempt
        self.lifecycle.on_finish = hooks.on_finish
        self.admission = Admission(
            self.cfg, self.kv, self.queues, self.lifecycle, self.stats, hooks.admissible
        )
        self.planner = RowPlanner(
            self.cfg,
            self.kv,
            self.queues,
            self.lifecycle,
            self.stats,
            self.max_model_len,
            hooks.on_row,
            self.speculation.drafts if self.speculation is not None else None,
        )
        self.results = ResultApplier(
            self.kv,
            self.lifecycle,
            self.stats,
            hooks.on_row_result,
            hooks.on_token,
            hooks.after_update,
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
        return len(self._launched)

    def wants_result_first(self) -> bool:
        """Whether the loop should apply the in-flight steps' results before planning the
        next (speculative decoding's rule, see radixrt.scheduler.speculation): one has verify
        rows, which a plan made now would leave out (they would advance every other step), or
        a row whose sample is in flight would draft. Other rows that wait for their host
        result (grammar masks, beams) are left out of the overlapped plan instead."""
        if any(launched.has_verify_rows for launched in self._launched.values()):
            return True
        spec = self.speculation
        return spec is not None and any(
            spec.would_draft(r)
            for r in self.queues.running
            if r.num_inflight_samples and r.status is Status.RUNNING
        )

    # ---- requests in and out ----
    def add_request(self, req: Request) -> None:
        """Queue a request. Raises ValueError when it can never fit (nothing is queued)."""
        self._check_fits(req, 1, "")
        for hook in self.hooks.on_add:
            hook(req)
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
        self.groups.add_group(parent)
        return children

    def add_beam_search(
        self, rid: str, prompt_ids: Sequence[int], params: BeamSearchParams, max_tokens: int
    ) -> Request:
        """Queue a beam search (`max_tokens` resolved against the context). The returned
        request gets one output when the search ends: `group.beam.finished`, best first.
        Raises ValueError on bad input (nothing is queued)."""
        req, beam, state = self.groups.beam_search(rid, prompt_ids, params, max_tokens)
        self._check_fits(req, params.beam_width, "beam_width")
        self.groups.add_group(self.groups.make_group(req, [beam], state))
        return req

    def _check_fits(self, req: Request, num_seqs: int, field_name: str) -> None:
        """RequestValueError (naming `field_name` when num_seqs > 1) unless `num_seqs`
        sequences of `req` sharing its prompt's full blocks (all but the last prompt token)
        fit in the pool together."""
        if req.rid in self.queues.requests:
            raise RequestValueError(f"request id {req.rid!r} is already in use")
        if num_seqs > self.kv.num_slots:
            raise RequestValueError(
                f"invalid {field_name}={num_seqs}: the engine runs at most "
                f"{self.kv.num_slots} sequences at once (max_running_requests)",
                field_name or None,
            )
        blocks = group_blocks_needed(
            req.prompt_len, req.max_tokens, num_seqs, self.kv.block_size, self.max_model_len
        )
        num_blocks = self.kv.allocator.num_blocks
        if blocks > num_blocks:
            what = f"{field_name}={num_seqs} sequences of " if num_seqs > 1 else ""
            raise RequestValueError(
                f"{what}prompt + max_tokens need {blocks} KV blocks but the pool has only "
                f"{num_blocks}; shorten the prompt or lower max_tokens"
                + (f" or {field_name}" if num_seqs > 1 else ""),
                field_name if num_seqs > 1 else "max_tokens",
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
        assert req.status is not Status.FINISHED
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

    # ---- scheduling ----
    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when no row can run now. Mutates request and cache
        state (blocks, locks, slots); the plan counts as in flight until `update`."""
        q, kv = self.queues, self.kv
        self.admission.new_step()
        ops = kv.step_ops()
        for hook in self.hooks.before_schedule:
            hook(ops)
        decode = self.planner.decode_rows()
        budget = self.cfg.max_num_batched_tokens - sum(1 + len(d) for _, d in decode)
        extend: list[tuple[Request, int]] = []
        for req in [r for r in q.running if schedulable(r) and extend_due(r)]:
            n = chunk_len(req, budget, self.cfg)
            if n == 0 or req.status is not Status.RUNNING:
                break
            if not kv.reserve(req, n) and not (
                not decode and not extend and self._preempt_until_reserved(req, n)
            ):
                break
            extend.append((req, n))
            budget -= n
        if budget > 0 and q.waiting:
            budget = self.admission.admit(budget, extend, ops)
        for req in q.waiting:
            req.waited_steps += 1
        if not decode and not extend:
            kv.keep_ops()  # no row: the ops wait (copies into blocks freed since went)
            return None
        step_id = next(self._step_ids)
        # one-token rows first (the decode kernel), then rows with drafts, then prefill chunks
        ordered = [(r, d) for r, d in decode if not d] + [(r, d) for r, d in decode if d]
        for hook in self.hooks.before_rows:
            hook([r for r, _ in decode] + [r for r, _ in extend])
        rows, reqs, failed = [], [], False
        no_drafts: list[int] = []
        tables = StepTables()
        for req, n, drafts in [(r, 1 + len(d), d) for r, d in ordered] + [
            (r, n, no_drafts) for r, n in extend
        ]:
            try:
                rows.append(self.planner.plan_row(req, n, drafts, tables))
            except Exception as e:  # a bug planning one request fails that request only
                self.lifecycle.finished_outside_update += self.lifecycle.fail(req, e)
                failed = True
                continue
            reqs.append(req)
        if failed:  # rows of a failed group's other members go too
            kept = [i for i, r in enumerate(reqs) if r.status is Status.RUNNING]
            rows, reqs = [rows[i] for i in kept], [reqs[i] for i in kept]
        if not rows:
            kv.keep_ops()
            return None
        ops = kv.launch_ops()
        verify = any(r.num_draft_tokens for r in rows)
        self._launched[step_id] = _Launched(reqs, [r.epoch for r in reqs], ops, verify)
        self.stats.steps += 1
        plan = StepPlan(step_id, rows, ops, new_slots=kv.entries.launch())
        tables.fill(plan)
        return plan

    def _preempt_until_reserved(self, req: Request, n: int) -> bool:
        """Nothing else runs this step and `req` (a running request with a chunk to feed,
        e.g. a jump-forward run) lacks blocks: preempt the newest other requests until it
        has them, so that running chunks cannot all wait on each other's blocks. False when
        `req` itself went (its group was the newest) or nothing else can go."""
        while not self.kv.reserve(req, n):
            if len(self.queues.running) < 2:
                return False
            self.lifecycle.preempt_newest(exclude=[req])
            if req.status is not Status.RUNNING:
                return False
        return True

    # ---- after the step ----
    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply an executed plan's result (plans are applied in the order they were
        made). Returns the requests that got tokens or finished."""
        launched = self._launched.pop(plan.step_id)
        return self.results.apply(plan, result, launched.requests, launched.epochs)

    def fail_step(self, plan: StepPlan, error: str) -> list[Request]:
        """The plan's execution failed: finish every request still in it (same incarnation)
        with FinishReason.ERROR. With host-tier swap ops in it, none of its block ops counts as
        done (`_discard_unmade_copies`). Returns the failed requests."""
        launched = self._launched.pop(plan.step_id)
        self.stats.failed_steps += 1
        failed = []
        for req, epoch in zip(launched.requests, launched.epochs):
            if req.epoch == epoch and req.status is Status.RUNNING:
                failed += self.lifecycle.fail(req, error)
        if any(is_swap(op) for op in plan.block_ops):
            self._discard_unmade_copies(plan)
        return failed

    def _discard_unmade_copies(self, plan: StepPlan) -> None:
        """The failed plan may have run none, some or all of its block ops: the blocks they
        write, and what later plans (and ops queued since) copied from those, hold unknown
        content. Requests holding such a device block or locking a node that loses a copy
        are preempted (they recompute, or load again from a valid host copy); then the cache
        forgets those copies, so no node claims KV that may never have been copied."""
        tiered = self.kv.host_cache
        assert tiered is not None and tiered.host is not None, "swap ops without a host tier"
        later = [self._launched[i].block_ops for i in sorted(self._launched) if i > plan.step_id]
        host = tiered.host
        later.append(self.kv.pending_ops + host.pending_ops)  # they run next, in this order
        device_blocks, host_blocks = unmade_blocks(plan.block_ops, later)
        stale = {id(n) for n in tiered.stale_nodes(device_blocks, host_blocks)}
        for req in list(self.queues.running):
            if req.status is Status.RUNNING and (
                not device_blocks.isdisjoint(req.block_table) or _on_path(req.cache_handle, stale)
            ):
                self.lifecycle.preempt(req)
        for rid, hold in list(self.retention.holds.items()):
            if _on_path(hold.handle, stale):
                self.retention.release(rid)
        tiered.discard_copies(device_blocks, host_blocks)
        host.uncount(plan.block_ops)

    # ---- integrity ----
    def check_integrity(self) -> None:
        """Every block reference, lock and slot is accounted for (see KVManager), groups and
        the features' own state are consistent."""
        q = self.queues
        groups = {id(r.group): r.group for r in q.requests.values() if r.group is not None}
        idle = list(q.waiting)
        reserved = []
        for g in groups.values():
            assert g.parent.status is not Status.FINISHED
            assert all(c.group is g and c.status is not Status.FINISHED for c in g.children)
            assert g.beam is None or len(g.children) <= g.beam.width
            idle += [c for c in g.children if c.status is Status.WAITING]
            if g.parent.status is Status.FORKED:
                idle.append(g.parent)
                assert not g.ready and g.children
            elif g.parent.status is Status.WAITING:
                assert not g.reserved_slots and not g.ready
                assert all(c.status is Status.WAITING for c in g.children)
            reserved += g.reserved_slots
        self.kv.check_integrity(q.running, idle, reserved)
        for hook in self.hooks.check_integrity:
            hook()


def _on_path(handle: Any, nodes: set[int]) -> bool:
    """Whether a node of the radix path root..handle is in `nodes` (ids)."""
    while handle is not None:
        if id(handle) in nodes:
            return True
        handle = handle.parent
    return False
