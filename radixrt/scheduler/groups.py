"""The scheduler half of request groups that share KV by block references: n > 1 forks and
beam search (see `RequestGroup` for the life of a group and `radixrt.scheduler.beam` for the beam
selection rule). Plain Python, no torch.

Forks: the parent computes the prompt but its last token; once its result is applied the next
`schedule()` forks it (`before_schedule`). Beams: every beam row returns its top log-probs
(it needs its result on the host); when all live beams of a group have theirs (`after_update`),
`_beam_step` picks the next beams and re-parents them by references (copies of partial blocks
are block ops of the next plan). Admission, preemption, abort and failure take a group as a
whole (`radixrt.scheduler.lifecycle`). A beam's top log-probs wait here (`_top_logprobs`) until
its group picks; a preempted or finished beam's are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from radixrt.plan import BlockOp, PlanRow, StepResult
from radixrt.sampling import DEFAULT_OPTIONS, BeamSearchParams, RequestOptions, SamplingParams
from radixrt.scheduler.beam import BeamState
from radixrt.scheduler.features import SchedulerFeature, StepTables
from radixrt.scheduler.kv_manager import KVManager
from radixrt.scheduler.lifecycle import Lifecycle
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import (
    FinishReason,
    Request,
    RequestGroup,
    RequestStatus,
    fork_rid,
)
from radixrt.stats import SchedulerCounters
from radixrt.tenant import Tenant


class GroupsFeature(SchedulerFeature):
    def __init__(
        self,
        kv: KVManager,
        queues: RequestQueues,
        lifecycle: Lifecycle,
        stats: SchedulerCounters,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.kv = kv
        self.queues = queues
        self.lifecycle = lifecycle
        self.stats = stats
        self.eos_token_ids = eos_token_ids
        self._beam_groups: dict[int, RequestGroup] = {}  # groups with beam results this update
        # a beam's top log-probs from its latest step, until its group picks the next beams
        self._top_logprobs: dict[Request, list[tuple[int, float]]] = {}

    # ---- adding ----
    def fork_children(self, req: Request) -> list[Request]:
        """The `req.params.n` children of an n > 1 request (ids `fork_rid(rid, i)`, child i
        seeded with (seed + i) mod 2**63)."""
        n = req.params.n
        assert n > 1
        seed = req.params.seed
        return [
            Request(
                rid=fork_rid(req.rid, i),
                prompt_len=req.prompt_len,
                seq_token_ids=list(req.seq_token_ids),
                params=replace(req.params, n=1, seed=None if seed is None else (seed + i) % 2**63),
                max_tokens=req.max_tokens,
                index=i,
                tenant=req.tenant,
                options=req.options,
            )
            for i in range(n)
        ]

    def beam_search(
        self,
        rid: str,
        prompt_ids: Sequence[int],
        params: BeamSearchParams,
        max_tokens: int,
        tenant: Tenant | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> tuple[Request, Request, BeamState]:
        """The request, its first beam and the search state of a beam search. Raises
        ValueError on bad input."""
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        params.check_candidates(len(self.eos_token_ids))
        k = params.num_candidates(len(self.eos_token_ids))
        beam_params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=True,
            top_logprobs=k,
        )
        ids = list(prompt_ids)
        req = Request(rid, len(ids), ids, beam_params, max_tokens, tenant=tenant, options=options)
        beam = Request(
            fork_rid(rid, 0),
            len(ids),
            list(ids),
            beam_params,
            max_tokens,
            reports=False,
            tenant=tenant,
            options=options,
        )
        state = BeamState(params.beam_width, k, max_tokens, params.length_penalty, eos)
        return req, beam, state

    def make_group(self, req: Request, children: list[Request], beam: BeamState | None) -> Request:
        """The group's parent (not queued yet: `add_group`), which computes the prompt but its
        last token and samples nothing."""
        assert req.prompt_len >= 1
        parent = Request(
            rid=req.rid,
            prompt_len=req.prompt_len - 1,
            seq_token_ids=req.seq_token_ids[:-1],
            params=req.params,
            max_tokens=0,
            reports=beam is not None,
            tenant=req.tenant,
            options=req.options,
        )
        group = RequestGroup(parent, children, beam=beam)
        parent.group = group
        for child in children:
            child.group = group
        return parent

    def add_group(self, parent: Request) -> None:
        """Queue a group by its parent (`make_group`)."""
        requests = self.queues.requests
        requests[parent.rid] = parent
        for child in parent.group.children:
            if child.reports:
                requests[child.rid] = child
        self.queues.waiting.append(parent)

    # ---- hooks ----
    def before_schedule(self, ops: list[BlockOp]) -> None:
        """Fork the parents whose prefill result is in."""
        for parent in [r for r in self.queues.running if r.group is not None and r.group.ready]:
            assert parent is parent.group.parent
            self._fork(parent.group, ops)

    def on_row(
        self, req: Request, row: PlanRow, drafts: list[int], samples: bool, tables: StepTables
    ) -> None:
        if _is_beam(req):  # its group picks the next beams from this row's top log-probs
            row.waits_for_result.append("beam")

    def on_row_result(self, req: Request, row: PlanRow, result: StepResult, i: int) -> bool:
        if req.reports:
            return False
        # a beam: its group picks the next beams once all its rows are in (after_update)
        req.num_inflight_samples -= 1
        self._top_logprobs[req] = result.top_logprobs[i][0]
        self._beam_groups[id(req.group)] = req.group
        return True

    def after_update(self, changed: list[Request]) -> None:
        groups, self._beam_groups = self._beam_groups, {}
        for g in groups.values():
            if g.parent.status is RequestStatus.FORKED and all(
                b in self._top_logprobs for b in g.children
            ):
                try:
                    self._beam_step(g, changed)
                except Exception as e:  # e.g. its scoring: fails this search only
                    changed += self.lifecycle.fail(g.parent, e)

    def on_preempt(self, req: Request) -> None:
        self._top_logprobs.pop(req, None)  # the group picks again after it recomputed

    def on_finish(self, req: Request) -> None:
        self._top_logprobs.pop(req, None)

    def check_integrity(self) -> None:
        assert all(b.status is RequestStatus.RUNNING and not b.reports for b in self._top_logprobs)

    def idle_members(self) -> tuple[list[Request], list[int]]:
        """The live groups' members that hold nothing but wait outside the waiting queue
        (children waiting inside their group, forked parents) and the slots reserved for
        children to come; asserts each group is consistent."""
        q = self.queues
        groups = {id(r.group): r.group for r in q.requests.values() if r.group is not None}
        idle: list[Request] = []
        reserved: list[int] = []
        for g in groups.values():
            assert g.parent.status is not RequestStatus.FINISHED
            assert all(c.group is g and c.status is not RequestStatus.FINISHED for c in g.children)
            assert g.beam is None or len(g.children) <= g.beam.width
            idle += [c for c in g.children if c.status is RequestStatus.WAITING]
            if g.parent.status is RequestStatus.FORKED:
                idle.append(g.parent)
                assert not g.ready and g.children
            elif g.parent.status is RequestStatus.WAITING:
                assert not g.reserved_slots and not g.ready
                assert all(c.status is RequestStatus.WAITING for c in g.children)
            reserved += g.reserved_slots
        return idle, reserved

    # ---- forking ----
    def _fork(self, g: RequestGroup, ops: list[BlockOp]) -> None:
        """Fork a ready parent into its children (see RequestGroup); waits a step when the
        partial-block copies find no free block."""
        kv = self.kv
        parent = g.parent
        full, partial = divmod(parent.num_computed, kv.block_size)
        children = g.children
        copies = kv.allocate(len(children) - 1) if partial else []
        if copies is None:
            return
        shared = parent.block_table[:full]
        for i, child in enumerate(children):
            if i == 0:  # takes over the parent's blocks, slot and lock
                child.block_table, child.slot = parent.block_table, parent.slot
                child.num_table_sent, child.cache_handle = (
                    parent.num_table_sent,
                    parent.cache_handle,
                )
            else:
                kv.share_prefix(parent, child, copies[i - 1] if partial else None, ops)
                child.slot = g.reserved_slots.pop()
            kv.entries.enter(child, source=parent)
            child.num_computed = child.num_kv_done = parent.num_computed
            self.queues.run(child)
        self.stats.forks += 1
        self.stats.fork_shared_blocks += len(shared) * (len(children) - 1)
        self.stats.fork_copied_blocks += len(copies)
        self.queues.running.remove(parent)
        parent.block_table, parent.slot, parent.cache_handle = [], None, None
        parent.num_computed = parent.num_kv_done = parent.num_table_sent = 0
        parent.status = RequestStatus.FORKED
        g.ready = False
        if g.beam is None:
            kv.give_slots(g.reserved_slots)
            g.reserved_slots = []

    def _beam_step(self, g: RequestGroup, changed: list[Request]) -> None:
        """Every live beam's top log-probs are in: pick the next beams (BeamState.step),
        re-parent them by block references, free dropped beams; or finish the search."""
        kv, lifecycle, running = self.kv, self.lifecycle, self.queues.running
        beams = g.children
        state = g.beam
        tops = self._top_logprobs
        picks = state.step([b.output_token_ids for b in beams], [tops.pop(b) for b in beams])
        self.stats.beam_steps += 1
        if not picks:
            for b in list(beams):
                lifecycle.finish_running(b, FinishReason.LENGTH)
            # the best sequence's reason: it ended with EOS, or reached max_tokens
            eos = bool(state.finished) and state.finished[0].output_token_ids[-1] in (
                state.eos_token_ids
            )
            lifecycle.stop(g.parent, FinishReason.STOP if eos else FinishReason.LENGTH)
            changed.append(g.parent)
            return
        # Each picked source continues in place once; dropped beams give back their blocks
        # (and slots to the group) before the other picks copy from their sources.
        first_pick: dict[int, int] = {}
        for j, c in enumerate(picks):
            first_pick.setdefault(c.beam, j)
        full, partial = divmod(beams[0].num_computed, kv.block_size)
        assert all(b.num_computed == beams[0].num_computed for b in beams)
        spare = [b for i, b in enumerate(beams) if i not in first_pick]
        for b in spare:
            running.remove(b)
            slot = b.slot
            b.slot = None
            kv.release(b)
            g.reserved_slots.append(slot)
        need = sum(1 for j, c in enumerate(picks) if first_pick[c.beam] != j) if partial else 0
        copies = kv.allocate(need) if need else []
        new: list[Request] = []
        for j, c in enumerate(picks):
            src = beams[c.beam]
            if first_pick[c.beam] == j:
                beam = src
            else:
                beam = Request(
                    fork_rid(g.parent.rid, len(new)),
                    src.prompt_len,
                    list(src.seq_token_ids),
                    src.params,
                    src.max_tokens,
                    group=g,
                    reports=False,
                    tenant=src.tenant,
                    options=src.options,
                )
                if copies is None:  # no block for the copy: recompute this beam later
                    beam.status = RequestStatus.WAITING
                else:
                    kv.share_prefix(src, beam, copies.pop() if partial else None, kv.pending_ops)
                    beam.slot = g.reserved_slots.pop()
                    kv.entries.enter(beam, source=src)
                    self.queues.run(beam)
                    self.stats.beam_shared_blocks += full
                    self.stats.beam_copied_blocks += 1 if partial else 0
            new.append(beam)
        for j, (beam, c) in enumerate(zip(new, picks)):
            beam.seq_token_ids.append(c.token)
            beam.index = j
        g.children = new
        if copies is None:
            lifecycle.preempt(g.parent)


def _is_beam(req: Request) -> bool:
    return req.group is not None and req.group.beam is not None and not req.reports
