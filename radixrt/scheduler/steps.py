"""One step of the scheduler: plan it, keep it in flight, apply or fail its result (plain
Python).

`StepPlanner.schedule()` plans decode rows first (one token each, with drafts under
speculative decoding), then continuing prefill chunks, then admits waiting requests in policy
order; the plan counts as in flight (`_Launched`: each row's request and incarnation) until
`update` applies its result or `fail_step` fails its requests.

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

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from radixrt.cache.tiers import unmade_blocks
from radixrt.config import SchedulerConfig
from radixrt.plan import BlockOp, StepPlan, StepResult
from radixrt.scheduler.admission import Admission
from radixrt.scheduler.features import Hooks, StepTables
from radixrt.scheduler.kv_manager import KVManager, is_swap
from radixrt.scheduler.lifecycle import Lifecycle
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Request, Status
from radixrt.scheduler.results import ResultApplier
from radixrt.scheduler.retention import RetentionFeature
from radixrt.scheduler.rows import RowPlanner, chunk_len, extend_due, schedulable
from radixrt.stats import SchedulerCounters


@dataclass
class _Launched:
    """Scheduler-side record of a plan in flight: which request (and incarnation) each row
    belongs to."""

    requests: list[Request]
    epochs: list[int]
    block_ops: list[BlockOp]  # the plan's (a failed earlier plan may have left them wrong inputs)
    has_verify_rows: bool  # rows with drafts (their next row starts where acceptance ends)


class StepPlanner:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVManager,
        queues: RequestQueues,
        lifecycle: Lifecycle,
        stats: SchedulerCounters,
        hooks: Hooks,
        admission: Admission,
        planner: RowPlanner,
        results: ResultApplier,
        retention: RetentionFeature,
        step_ids: Iterator[int],
    ) -> None:
        """`hooks`: the features' (`before_schedule`, `before_rows`); `retention`: its holds
        go when a failed plan leaves their paths' KV unknown; `step_ids`: the plans' ids."""
        self.cfg = cfg
        self.kv = kv
        self.queues = queues
        self.lifecycle = lifecycle
        self.stats = stats
        self.hooks = hooks
        self.admission = admission
        self.planner = planner
        self.results = results
        self.retention = retention
        self._step_ids = step_ids
        self._launched: dict[int, _Launched] = {}  # by step id, in launch order

    @property
    def num_inflight(self) -> int:
        return len(self._launched)

    @property
    def has_verify_rows(self) -> bool:
        """Whether a plan in flight has rows with drafts."""
        return any(launched.has_verify_rows for launched in self._launched.values())

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


def _on_path(handle: Any, nodes: set[int]) -> bool:
    """Whether a node of the radix path root..handle is in `nodes` (ids)."""
    while handle is not None:
        if id(handle) in nodes:
            return True
        handle = handle.parent
    return False
