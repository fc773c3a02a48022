"""Applying an executed plan's result (plain Python, no torch).

`apply(plan, result, requests, epochs)` appends each row's accepted tokens (1..k+1 with
speculation; stopping at a stop condition inside them), rolls back rejected drafts' KV, inserts
what was computed into the prefix cache, finishes requests and frees their KV. A bug in one
request's bookkeeping fails that request (its group) alone. Results of rows whose request was
aborted, finished or preempted since the plan was made (another epoch) are ignored. Features
see each row's result (`on_row_result`: a beam's row is its group's), each appended token
(`on_token`) and the whole update (`after_update`).
"""

from __future__ import annotations

from collections.abc import Callable

from radixrt.deltas import FinishReason
from radixrt.plan import PlanRow, StepPlan, StepResult
from radixrt.scheduler.kv_manager import KVManager
from radixrt.scheduler.lifecycle import Lifecycle
from radixrt.scheduler.request import Request, RequestStatus
from radixrt.stats import SchedulerCounters


class ResultApplier:
    def __init__(
        self,
        kv: KVManager,
        lifecycle: Lifecycle,
        stats: SchedulerCounters,
        on_row_result: list[Callable[[Request, PlanRow, StepResult, int], bool]],
        on_token: list[Callable[[Request, int], FinishReason | None]],
        after_update: list[Callable[[list[Request]], None]],
    ) -> None:
        """The lists are the features' hooks (see `radixrt.scheduler.features`)."""
        self.kv = kv
        self.lifecycle = lifecycle
        self.stats = stats
        self.on_row_result = on_row_result
        self.on_token = on_token
        self.after_update = after_update

    def apply(
        self, plan: StepPlan, result: StepResult, requests: list[Request], epochs: list[int]
    ) -> list[Request]:
        """Apply an executed plan's result (plans are applied in the order they were made);
        `requests` and `epochs`: each row's request and its incarnation when planned.
        Returns the requests that got tokens or finished."""
        assert result.step_id == plan.step_id
        changed: list[Request] = []
        for i, (row, req, epoch) in enumerate(zip(plan.rows, requests, epochs)):
            if req.epoch != epoch or req.status is not RequestStatus.RUNNING:
                self.stats.dropped_tokens += len(result.tokens[i])
                continue  # finished, aborted or preempted since the plan was made
            try:
                self.apply_row(req, row, result, i, changed)
            except Exception as e:  # a bug in one request's bookkeeping fails it (its group)
                changed += self.lifecycle.fail(req, e)
        for hook in self.after_update:
            hook(changed)
        return changed

    def apply_row(
        self, req: Request, row: PlanRow, result: StepResult, i: int, changed: list[Request]
    ) -> None:
        """Apply row i of a result to its (still running) request."""
        if row.waits_for_result:
            req.awaiting_result_for = ()
        if row.prompt_logprobs is not None:
            req.prompt_logprobs += result.prompt_logprobs[i]
        req.num_kv_done = max(req.num_kv_done, row.end)
        if not row.sample_offsets:
            if req.max_tokens == 0 and row.end == len(req.seq_token_ids):
                if req.group is not None and req is req.group.parent:  # fork next schedule()
                    self.kv.cache_progress(req, row.end)
                    req.group.ready = True
                    return
                changed.append(req)  # prefill-only (scoring / cache warming): done
                self.lifecycle.finish_running(req, FinishReason.LENGTH)
            else:  # a prefill chunk: share its progress with others at once
                self.kv.cache_progress(req, row.end)
            return
        # a last prefill chunk (a verify row feeds k + 1 tokens but is a decode row)
        if row.num_tokens - row.num_draft_tokens > 1 or row.start < req.prompt_len:
            self.kv.cache_progress(req, row.end)
        for hook in self.on_row_result:
            if hook(req, row, result, i):
                return
        changed.append(req)
        self.accept(req, row, result, i)

    def accept(self, req: Request, row: PlanRow, result: StepResult, i: int) -> None:
        """Append the row's accepted tokens, stopping at the first stop condition."""
        tokens = result.tokens[i]
        req.num_inflight_samples -= 1
        req.num_output_counted += len(tokens)  # the runner counted them in its slot
        if row.num_draft_tokens:
            # Drafts past the accepted ones were fed with wrong KV: roll back to the
            # accepted length (the KV of the last accepted token is computed next step).
            req.num_computed = req.num_kv_done = row.start + len(tokens)
            self.kv.truncate(req)  # (speculation counted the row at on_row_result)
        p = req.params
        stop_reason = self.lifecycle.stop_reason
        for j, token in enumerate(tokens):
            req.seq_token_ids.append(token)
            if p.logprobs:
                req.output_logprobs.append(result.logprobs[i][j])
            if p.top_logprobs:
                req.output_top_logprobs.append(result.top_logprobs[i][j])
            self.stats.generated_tokens += 1
            reason = stop_reason(req, token)
            for hook in self.on_token:
                reason = hook(req, token) or reason
            if reason is not None:
                self.stats.dropped_tokens += len(tokens) - j - 1
                self.lifecycle.finish_running(req, reason)
                return
