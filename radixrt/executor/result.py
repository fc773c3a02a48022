"""A step's outputs on their way to the host, and their assembly into a StepResult.

On CUDA the device tensors are copied into pinned host memory with non-blocking copies and an
event is recorded; `result()` waits for that event only (the GPU may already run the next
step). On a CPU the copies are plain and `result()` returns at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.executor.inputs import StepLayout
from radixrt.plan import StepPlan, StepResult


@dataclass
class StepOutputs:
    """Device outputs of one step (None when absent)."""

    tokens: torch.Tensor | None = None  # [S] int64: a token per sample position
    logprobs: torch.Tensor | None = None  # [S] float32, when any row asked
    top_ids: torch.Tensor | None = None  # [S, k] int64, when any row asked for top-k
    top_logprobs: torch.Tensor | None = None  # [S, k] float32
    num_accepted: torch.Tensor | None = None  # [rows with drafts] int64: accepted drafts
    prompt_logprobs: torch.Tensor | None = None  # [P] float32: scored prompt tokens


def _to_host(t: torch.Tensor | None, copy: bool) -> torch.Tensor | None:
    if t is None or not copy:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class PendingResult:
    """StepHandle of a ModelRunner step."""

    def __init__(
        self, plan: StepPlan, layout: StepLayout, outputs: StepOutputs, *, copy_to_host: bool
    ) -> None:
        self._plan = plan
        self._layout = layout
        o = outputs
        self._host = StepOutputs(
            *(
                _to_host(t, copy_to_host)
                for t in (
                    o.tokens,
                    o.logprobs,
                    o.top_ids,
                    o.top_logprobs,
                    o.num_accepted,
                    o.prompt_logprobs,
                )
            )
        )
        self._event = None
        if copy_to_host:
            self._event = torch.cuda.Event()
            self._event.record()
        self._result: StepResult | None = None

    def ready(self) -> bool:
        """Whether `result()` would return without waiting for the device."""
        return self._event is None or self._event.query()

    def result(self) -> StepResult:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = assemble(self._plan, self._layout, self._host)
        return self._result


def assemble(plan: StepPlan, layout: StepLayout, out: StepOutputs) -> StepResult:
    """Per-row lists from the flat host outputs."""
    num_rows = len(plan.rows)
    if layout.one_sample_per_row and out.tokens is not None and _tokens_only(out):
        # a plain decode step: sample i is row i's only token
        empty = [[] for _ in range(3 * num_rows)]
        return StepResult(
            plan.step_id,
            [[t] for t in out.tokens.tolist()],
            empty[:num_rows],
            empty[num_rows : 2 * num_rows],
            empty[2 * num_rows :],
        )
    tokens: list[list[int]] = [[] for _ in range(num_rows)]
    logprobs: list[list[float]] = [[] for _ in range(num_rows)]
    top: list[list[list[tuple[int, float]]]] = [[] for _ in range(num_rows)]
    scores: list[list[float]] = [[] for _ in range(num_rows)]
    if out.tokens is not None:
        flat = out.tokens.tolist()
        lps = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        accepted = out.num_accepted.tolist() if out.num_accepted is not None else []
        drafting = 0
        firsts, counts = layout.row_first_sample.tolist(), layout.num_samples.tolist()
        for i, row in enumerate(plan.rows):
            if not counts[i]:
                continue
            first = firsts[i]
            n = 1
            if row.num_draft_tokens:
                n = accepted[drafting] + 1
                drafting += 1
            else:
                first += counts[i] - 1  # the last listed position (one sample per row)
            tokens[i] = flat[first : first + n]
            p = layout.sample_params[first]
            if p.logprobs and lps is not None:
                logprobs[i] = lps[first : first + n]
            if p.top_logprobs and top_ids is not None:
                k = p.top_logprobs
                top[i] = [
                    list(zip(top_ids[j][:k], top_lps[j][:k], strict=True))
                    for j in range(first, first + n)
                ]
    if out.prompt_logprobs is not None:
        flat_scores = out.prompt_logprobs.tolist()
        for i, start, count in layout.score_rows:
            scores[i] = flat_scores[start : start + count]
    return StepResult(plan.step_id, tokens, logprobs, top, scores)


def _tokens_only(out: StepOutputs) -> bool:
    """No log-probs, top log-probs, accepted-draft counts or prompt scores came back."""
    return (
        out.logprobs is None
        and out.top_ids is None
        and out.num_accepted is None
        and out.prompt_logprobs is None
    )
