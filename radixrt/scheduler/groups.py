"""Scheduling of request groups that share KV by block references: n > 1 forks and beam
search (the `Scheduler`'s group methods, a mixin; see `ForkGroup` for the life of a group and
`radixrt.scheduler.beam` for the beam selection rule).

Forks: the parent computes the prompt but its last token; once its result is applied the next
`schedule()` forks it (`_fork`). Beams: every beam row returns its top log-probs
(needs_host_result); when all live beams of a group have theirs, `_beam_step` picks the next
beams and re-parents them by references (copies of partial blocks are block ops of the next
plan). Plain Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from radixrt.limits import group_blocks_needed
from radixrt.sampling import BeamSearchParams, SamplingParams
from radixrt.scheduler.beam import BeamState
from radixrt.scheduler.request import FinishReason, ForkGroup, Request, Status, fork_rid


class GroupScheduling:
    """Mixin of `Scheduler`: it uses the scheduler's queues, allocator, cache and stats."""

    def _check_fits(self, req: Request, num_seqs: int, field_name: str) -> None:
        """ValueError unless `num_seqs` sequences of `req` sharing its prompt's full blocks
        (all but the last prompt token) fit in the pool together."""
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        if num_seqs > self.kv.num_slots:
            raise ValueError(
                f"invalid {field_name}={num_seqs}: the engine runs at most "
                f"{self.kv.num_slots} sequences at once (max_running_requests)"
            )
        blocks = group_blocks_needed(
            req.prompt_len, req.max_tokens, num_seqs, self.kv.block_size, self.max_model_len
        )
        if blocks > self.kv.allocator.num_blocks:
            what = f"{field_name}={num_seqs} sequences of " if num_seqs > 1 else ""
            raise ValueError(
                f"{what}prompt + max_tokens need {blocks} KV blocks but the pool has only "
                f"{self.kv.allocator.num_blocks}; shorten the prompt or lower max_tokens"
                + (f" or {field_name}" if num_seqs > 1 else "")
            )

    def add_fork(self, req: Request) -> list[Request]:
        """Queue an n > 1 request (`req.params.n` children, ids `fork_rid(rid, i)`, child i
        seeded with (seed + i) mod 2**63). Returns the children; the parent `req.rid` gets
        no outputs of its own. Raises ValueError when the n sequences can never fit."""
        n = req.params.n
        assert n > 1
        self._check_fits(req, n, "n")
        self._submit_grammar(req)  # the parent waits for it; each child gets a matcher
        seed = req.params.seed
        children = [
            Request(
                rid=fork_rid(req.rid, i),
                prompt_len=req.prompt_len,
                seq_token_ids=list(req.seq_token_ids),
                params=replace(req.params, n=1, seed=None if seed is None else (seed + i) % 2**63),
                max_tokens=req.max_tokens,
                index=i,
            )
            for i in range(n)
        ]
        self._add_group(req, children, None)
        return children

    def add_beam_search(
        self, rid: str, prompt_ids: Sequence[int], params: BeamSearchParams, max_tokens: int
    ) -> Request:
        """Queue a beam search (`max_tokens` resolved against the context). The returned
        request gets one output when the search ends: `group.beam.finished`, best first.
        Raises ValueError on bad input (nothing is queued)."""
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        params.check_candidates(len(self.eos_token_ids))
        k = params.num_candidates(len(self.eos_token_ids))
        beam_params = SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True, top_logprobs=k
        )
        ids = list(prompt_ids)
        req = Request(rid, len(ids), ids, beam_params, max_tokens)
        self._check_fits(req, params.beam_width, "beam_width")
        beam = Request(
            fork_rid(rid, 0), len(ids), list(ids), beam_params, max_tokens, reports=False
        )
        state = BeamState(params.beam_width, k, max_tokens, params.length_penalty, eos)
        self._add_group(req, [beam], state)
        return req

    def _add_group(self, req: Request, children: list[Request], beam: BeamState | None) -> None:
        """The parent computes the prompt but its last token and samples nothing."""
        assert req.prompt_len >= 1
        parent = Request(
            rid=req.rid,
            prompt_len=req.prompt_len - 1,
            seq_token_ids=req.seq_token_ids[:-1],
            params=req.params,
            max_tokens=0,
            reports=beam is not None,
            grammar_ticket=req.grammar_ticket,
        )
        group = ForkGroup(parent, children, beam=beam)
        parent.group = group
        self.requests[parent.rid] = parent
        for child in children:
            child.group = group
            if child.reports:
                self.requests[child.rid] = child
        self.waiting.append(parent)

    def _fork(self, g: ForkGroup, ops: list) -> None:
        """Fork a ready parent into its children (see ForkGroup); waits a step when the
        partial-block copies find no free block."""
        parent = g.parent
        full, partial = divmod(parent.num_computed, self.kv.block_size)
        children = g.children
        copies = self.kv.allocate(len(children) - 1) if partial else []
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
                self.kv.share_prefix(parent, child, copies[i - 1] if partial else None, ops)
                child.slot = g.reserved_slots.pop()
            child.num_computed = child.num_kv_done = parent.num_computed
            child.status = Status.RUNNING
            self._admissions += 1
            child.admission_seq = self._admissions
            self.running.append(child)
        self.stats.num_forks += 1
        self.stats.num_fork_shared_blocks += len(shared) * (len(children) - 1)
        self.stats.num_fork_copied_blocks += len(copies)
        self.running.remove(parent)
        parent.block_table, parent.slot, parent.cache_handle = [], None, None
        parent.num_computed = parent.num_kv_done = parent.num_table_sent = 0
        parent.status = Status.FORKED
        g.ready = False
        if g.beam is None:
            self.kv.give_slots(g.reserved_slots)
            g.reserved_slots = []

    def _fail_group(self, req: Request, error: Exception | str) -> list[Request]:
        """A member of a group failed (planning or applying its result): fail every
        unfinished member with FinishReason.ERROR, releasing all their blocks, locks and
        slots; other requests go on. Returns the failed members that report (an n > 1
        request's children; a beam search's parent)."""
        g = req.group
        assert g is not None
        failed = []
        for member in [*g.children, g.parent]:  # the last n > 1 child finishes the parent
            if member.status is not Status.FINISHED:
                self._fail_one(member, error)
                if member.reports:
                    failed.append(member)
        return failed

    def _beam_step(self, g: ForkGroup, changed: list[Request]) -> None:
        """Every live beam's top log-probs are in: pick the next beams (BeamState.step),
        re-parent them by block references, free dropped beams; or finish the search."""
        beams = g.children
        state = g.beam
        picks = state.step(
            [b.output_token_ids for b in beams], [b.beam_top_logprobs for b in beams]
        )
        for b in beams:
            b.beam_top_logprobs = None
        self.stats.num_beam_steps += 1
        if not picks:
            for b in list(beams):
                self.running.remove(b)
                self._finish(b, FinishReason.LENGTH)
            # the best sequence's reason: it ended with EOS, or reached max_tokens
            eos = bool(state.finished) and state.finished[0].output_token_ids[-1] in (
                state.eos_token_ids
            )
            self._stop(g.parent, FinishReason.STOP if eos else FinishReason.LENGTH)
            changed.append(g.parent)
            return
        # Each picked source continues in place once; dropped beams give back their blocks
        # (and slots to the group) before the other picks copy from their sources.
        first_pick: dict[int, int] = {}
        for j, c in enumerate(picks):
            first_pick.setdefault(c.beam, j)
        full, partial = divmod(beams[0].num_computed, self.kv.block_size)
        assert all(b.num_computed == beams[0].num_computed for b in beams)
        spare = [b for i, b in enumerate(beams) if i not in first_pick]
        for b in spare:
            self.running.remove(b)
            slot = b.slot
            b.slot = None
            self.kv.release(b)
            g.reserved_slots.append(slot)
        need = sum(1 for j, c in enumerate(picks) if first_pick[c.beam] != j) if partial else 0
        copies = self.kv.allocate(need) if need else []
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
                )
                if copies is None:  # no block for the copy: recompute this beam later
                    beam.status = Status.WAITING
                else:
                    self.kv.share_prefix(
                        src, beam, copies.pop() if partial else None, self.kv.pending_ops
                    )
                    beam.slot = g.reserved_slots.pop()
                    beam.status = Status.RUNNING
                    self._admissions += 1
                    beam.admission_seq = self._admissions
                    self.running.append(beam)
                    self.stats.num_beam_shared_blocks += full
                    self.stats.num_beam_copied_blocks += 1 if partial else 0
            new.append(beam)
        for j, (beam, c) in enumerate(zip(new, picks)):
            beam.seq_token_ids.append(c.token)
            beam.index = j
        g.children = new
        if copies is None:
            self._preempt(g.parent)
