"""Row planning: which running requests feed tokens this step and the PlanRow of each (a
mixin of `Scheduler`; plain Python).

Decode rows first (one token each, plus drafts with a proposer: the token budget left after
one token per decode row), then prefill chunks. `_plan_row` turns a request's next tokens into
a PlanRow (block-table delta, sample positions, drafts, bitmasks, prompt log-probs) and marks
them computed and the sample in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from radixrt.plan import PlanRow, PromptLogprobs
from radixrt.scheduler.request import Request, Status

_ADMISSION_ORDER = attrgetter("admission_seq")


class RowPlanning:
    """Mixin: needs the Scheduler's cfg, running, proposer, stats, max_model_len, _reserve,
    _preempt, _newest_preemptible, _fail / _finished_outside_update (a request whose drafting
    raises fails alone) and the grammar mixin's _grammar_drafts / _grammar_masks."""

    def _schedulable(self, req: Request) -> bool:
        """Running and not waiting for the host result of a step in flight."""
        return req.status is Status.RUNNING and not req.awaiting_host_result

    @staticmethod
    def _extend_due(req: Request) -> bool:
        """More than one token to feed (a prefill chunk), or a prompt-only request's last."""
        pending = req.num_pending
        return pending > 1 or (req.max_tokens == 0 and pending == 1)

    def _decode_due(self, req: Request) -> bool:
        """One token to feed, and the sample it makes may still be kept (a request whose
        in-flight samples already reach max_tokens or the context waits for them)."""
        seq_len = req.seq_len  # (the properties once: this runs per running request a step)
        return (
            seq_len - req.num_computed == 1  # num_pending
            and seq_len - req.prompt_len < req.max_tokens  # num_output + in-flight samples
            and seq_len < self.max_model_len
        )

    def _schedule_decode(self) -> list[tuple[Request, list[int]]]:
        """Decode rows and their drafts ([] without speculation)."""
        scheduled: list[tuple[Request, list[int]]] = []
        due = [
            r
            for r in sorted(self.running, key=_ADMISSION_ORDER)
            if self._schedulable(r) and self._decode_due(r)
        ]
        # drafts take what the token budget leaves after one token for every decode row
        spare = self.cfg.max_num_batched_tokens - len(due)
        for req in due:
            if req.status is not Status.RUNNING:
                continue  # preempted for an earlier row's blocks
            try:
                drafts = self._drafts(req, spare)
            except Exception as e:  # a bug drafting for one request fails that request only
                self._finished_outside_update += self._fail(req, e)
                scheduled = [(r, d) for r, d in scheduled if r.status is Status.RUNNING]
                continue
            spare -= len(drafts)
            while not self._reserve(req, 1 + len(drafts)):
                victim = self._newest_preemptible(exclude=[r for r, _ in scheduled])
                self._preempt(victim)
                # a group goes as a whole, rows already picked for it too
                scheduled = [(r, d) for r, d in scheduled if r.status is Status.RUNNING]
                if req.status is not Status.RUNNING:
                    break
            else:
                scheduled.append((req, drafts))
        return scheduled

    def _drafts(self, req: Request, spare: int) -> list[int]:
        """Draft tokens for a decode row: only with a proposer, the row's last token on the
        host, and room for them (max_tokens, the context and `spare` tokens of the step's
        budget). Beams never draft (their group picks one token per beam from top
        log-probs). Rows with penalties draft: the runner penalises each position with the
        drafts before it counted (`radixrt.engine.spec_penalties`)."""
        if self.proposer is None or req.num_inflight_samples:
            return []
        if req.grammar is not None and getattr(self.proposer, "drafts_on_device", False):
            return []  # device drafts cannot be checked against the grammar
        if not req.reports:
            return []
        room = min(
            req.max_tokens - req.num_output - 1,
            self.max_model_len - len(req.seq_token_ids) - 1,
            spare,
        )
        k = min(self.cfg.num_speculative_tokens, room)
        if k <= 0:
            return []
        drafts = self.proposer.propose(req, k)[:k]
        if req.grammar is not None and drafts:
            drafts = self._grammar_drafts(req, drafts)
        self.stats.spec.num_proposals += 1
        self.stats.spec.num_proposals_with_drafts += bool(drafts)
        return drafts

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_pending, budget)
        if self.cfg.long_prefill_token_threshold:
            n = min(n, self.cfg.long_prefill_token_threshold)
        return max(n, 0)

    def _plan_row(self, req: Request, n: int, drafts: Sequence[int] = ()) -> PlanRow:
        """The row of `req` feeding its next `n` tokens (the last len(drafts) of them
        drafts); marks them computed and the sample in flight."""
        start, seq = req.num_computed, req.seq_token_ids
        p = req.params
        reads_last = req.num_inflight_samples > 0
        assert not reads_last or (n == 1 and start == len(seq)), "one in-flight sample at most"
        k = len(drafts)
        samples = start + n - k == req.seq_len and req.max_tokens > 0
        if reads_last:
            input_ids = []
        else:
            input_ids = seq[start : start + n - k] + list(drafts) if k else seq[start : start + n]
        row = PlanRow(
            rid=req.rid,
            slot=req.slot,
            start=start,
            num_tokens=n,
            input_ids=input_ids,
            reads_last_sample=reads_last,
            table_start=req.num_table_sent,
            new_blocks=req.block_table[req.num_table_sent :],
            sample_offsets=list(range(n - 1 - k, n)) if samples else [],
            num_draft_tokens=k,
            drafts_on_device=k > 0 and getattr(self.proposer, "drafts_on_device", False),
            params=p,
            num_output_before=req.num_output + req.num_inflight_samples,
        )
        req.num_table_sent = len(req.block_table)
        penalties = p.has_penalties
        if penalties:
            row.history, row.prompt_len = list(seq), req.prompt_len
        # Penalties need the whole output on the host; so does the proposer, to draft, and
        # beam search, to pick the next beams.
        is_beam = req.group is not None and req.group.beam is not None and req.reports is False
        row.needs_host_result = penalties or self.proposer is not None or is_beam
        if req.grammar is not None and samples:  # the next mask needs this step's token
            row.token_bitmask = self._grammar_masks(req, drafts)
            row.needs_host_result = True
        if start < req.prompt_len:
            self.stats.num_prompt_tokens_computed += min(start + n, req.prompt_len) - start
        if p.prompt_logprobs:
            lo = max(start, p.logprob_start_len - 1)
            hi = min(start + n, req.prompt_len - 1)
            if hi > lo:
                row.prompt_logprobs = PromptLogprobs(lo - start, seq[lo + 1 : hi + 1])
        req.num_computed += n
        if samples:
            req.num_inflight_samples += 1
        req.awaiting_host_result = row.needs_host_result
        return row
