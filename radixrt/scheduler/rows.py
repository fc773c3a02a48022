"""Row planning: which running requests feed tokens this step and the PlanRow of each (plain
Python).

Decode rows first (one token each, plus drafts with speculative decoding: the token budget left
after one token per decode row), then prefill chunks. `plan_row` turns a request's next tokens
into a PlanRow (block-table delta, sample positions, prompt log-probs; a slot entry when the
slot's penalty counts miss host-appended tokens; features add their side tables, drafts and
bitmasks, at the `on_row` hook into `StepTables`) and marks them computed and the sample in
flight.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Protocol

from radixrt.config import SchedulerConfig
from radixrt.plan import PlanRow, PromptLogprobs
from radixrt.scheduler.features import StepTables
from radixrt.scheduler.kv_manager import KVManager
from radixrt.scheduler.lifecycle import Lifecycle
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Request, RequestStatus
from radixrt.stats import SchedulerCounters

_ADMISSION_ORDER = attrgetter("priority", "admission_seq")  # decode rows reserve in this order


# (request, its row, its drafts, whether the row samples, the step's side tables) -> None:
# a feature's on_row hook
RowHook = Callable[[Request, PlanRow, list[int], bool, StepTables], None]


class Drafter(Protocol):
    """Speculative decoding's scheduler half (radixrt.scheduler.speculation), as rows see it."""

    def drafts(self, req: Request, spare: int) -> list[int]:
        """At most `spare` draft tokens proposed for `req`'s decode row."""
        ...

    def choose(
        self, proposals: list[tuple[Request, list[int]]], num_rows: int, spare: int
    ) -> dict[Request, list[int]]:
        """The drafts this step verifies, out of the rows' proposals (`num_rows` decode
        rows, at most `spare` draft tokens in all)."""
        ...


def chunk_len(req: Request, budget: int, cfg: SchedulerConfig) -> int:
    """Tokens of `req`'s pending ones to feed in this step's row (a prefill chunk)."""
    n = min(req.num_pending, budget)
    if cfg.long_prefill_token_threshold:
        n = min(n, cfg.long_prefill_token_threshold)
    return max(n, 0)


def schedulable(req: Request) -> bool:
    """Running and not waiting for the host result of a step in flight."""
    return req.status is RequestStatus.RUNNING and not req.awaiting_result_for


def extend_due(req: Request) -> bool:
    """More than one token to feed (a prefill chunk), or a prompt-only request's last."""
    pending = req.num_pending
    return pending > 1 or (req.max_tokens == 0 and pending == 1)


class RowPlanner:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVManager,
        queues: RequestQueues,
        lifecycle: Lifecycle,
        stats: SchedulerCounters,
        max_model_len: int,
        on_row: list[RowHook],
        drafter: Drafter | None,
    ) -> None:
        """`on_row`: the features' row hooks; `drafter`: speculative decoding's drafts (None:
        no speculation)."""
        self.cfg = cfg
        self.kv = kv
        self.queues = queues
        self.lifecycle = lifecycle
        self.stats = stats
        self.max_model_len = max_model_len
        self.on_row = on_row
        self.drafter = drafter

    def _decode_due(self, req: Request) -> bool:
        """One token to feed, and the sample it makes may still be kept (a request whose
        in-flight samples already reach max_tokens or the context waits for them)."""
        seq_len = req.seq_len  # (the properties once: this runs per running request a step)
        return (
            seq_len - req.num_computed == 1  # num_pending
            and seq_len - req.prompt_len < req.max_tokens  # num_output + in-flight samples
            and seq_len < self.max_model_len
        )

    def decode_rows(self) -> list[tuple[Request, list[int]]]:
        """Decode rows and their drafts ([] without speculation), blocks reserved (newest
        requests preempted when the pool is short)."""
        scheduled: list[tuple[Request, list[int]]] = []
        due = [
            r
            for r in sorted(self.queues.running, key=_ADMISSION_ORDER)
            if schedulable(r) and self._decode_due(r)
        ]
        chosen = self._drafts(due) if self.drafter is not None else {}
        for req in due:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier row's blocks, or failed drafting
            drafts = chosen.get(req, [])
            while not self.kv.reserve(req, 1 + len(drafts)):
                self.lifecycle.preempt_newest(exclude=[r for r, _ in scheduled])
                # a group goes as a whole, rows already picked for it too
                scheduled = [(r, d) for r, d in scheduled if r.status is RequestStatus.RUNNING]
                if req.status is not RequestStatus.RUNNING:
                    break
            else:
                scheduled.append((req, drafts))
        return scheduled

    def _drafts(self, due: list[Request]) -> dict[Request, list[int]]:
        """The drafts of this step's decode rows: each row's proposal, then the drafter's
        choice among them. Drafts take what the token budget leaves after one token for every
        decode row."""
        assert self.drafter is not None
        spare = self.cfg.max_num_batched_tokens - len(due)
        proposals = []
        for req in due:
            try:
                drafts = self.drafter.drafts(req, spare)
            except Exception as e:  # a bug drafting for one request fails that request only
                self.lifecycle.fail_outside_update(req, e)
                continue
            if drafts:
                proposals.append((req, drafts))
        proposals = [(r, d) for r, d in proposals if r.status is RequestStatus.RUNNING]
        return self.drafter.choose(proposals, len(due), spare) if proposals else {}

    def plan_row(self, req: Request, n: int, drafts: list[int], tables: StepTables) -> PlanRow:
        """The row of `req` feeding its next `n` tokens (the last len(drafts) of them
        drafts, which features put in `tables`); marks them computed and the sample in
        flight."""
        start, seq = req.num_computed, req.seq_token_ids
        p = req.params
        reads_last = req.num_inflight_samples > 0
        k = len(drafts)
        assert not reads_last or (n == 1 + k and start == len(seq)), "one in-flight sample"
        samples = start + n - k == req.seq_len and req.max_tokens > 0
        input_ids = [] if reads_last else seq[start : start + n - k]
        if self.kv.entries.recount_due(req):  # host-appended output: count it all again
            assert not reads_last, "tokens appended on the host while a sample was in flight"
            self.kv.entries.enter(req)
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
            num_output_before=req.num_output + req.num_inflight_samples,
        )
        req.num_table_sent = len(req.block_table)
        for hook in self.on_row:
            hook(req, row, drafts, samples, tables)
        if start < req.prompt_len:
            self.stats.prompt_tokens_computed += min(start + n, req.prompt_len) - start
        if p.prompt_logprobs:
            lo = max(start, p.logprob_start_len - 1)
            hi = min(start + n, req.prompt_len - 1)
            if hi > lo:
                row.prompt_logprobs = PromptLogprobs(lo - start, seq[lo + 1 : hi + 1])
        req.num_computed += n
        if samples:
            req.num_inflight_samples += 1
        req.awaiting_result_for = tuple(row.waits_for_result)
        return row
