"""A scripted runner: executes step plans without a model (scheduler tests, simulations).

It keeps the row state a real runner keeps (each slot's block table and last sample) and
checks every plan against it, so a plan that would make a real runner read the wrong token or
block fails here too. Tokens come from `token_fn(rid, position) -> token` (the token sampled
after the sequence's first `position` tokens; deterministic by default, so runs with and
without overlap or caching must agree). Plain Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixrt.plan import CopyBlock, PlanRow, StepPlan, StepResult


def default_token(rid: str, position: int) -> int:
    """A deterministic token for the sample after `position` sequence tokens."""
    return 7 + (hash((rid, position)) & 0xFFFF) % 1000


@dataclass
class ScriptedRunner:
    num_slots: int
    block_size: int
    token_fn: Callable[[str, int], int] = default_token
    # draft rows: accept this many drafts (capped at the row's drafts); None: all
    accept_fn: Callable[[PlanRow], int] | None = None
    # ("execute" | "result", step id) in call order: shows whether a loop overlaps
    events: list[tuple[str, int]] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)  # slot -> block table
    last_sample: dict[int, int] = field(default_factory=dict)  # slot -> token (the "device")
    num_computed_tokens: int = 0  # tokens fed, over all steps
    copies: list[CopyBlock] = field(default_factory=list)

    def execute(self, plan: StepPlan) -> _Handle:
        self.events.append(("execute", plan.step_id))
        tokens, lps, tops, scores = [], [], [], []
        for row in plan.rows:
            table = self.tables.setdefault(row.slot, [])
            del table[row.table_start :]
            table += row.new_blocks
            assert len(table) * self.block_size >= row.end, f"{row.rid}: no block for its KV"
            if row.reads_last_sample:
                assert row.slot in self.last_sample, f"{row.rid}: no sample on the device"
            self.num_computed_tokens += row.num_tokens
            out: list[int] = []
            if row.sample_offsets:
                n = len(row.sample_offsets)
                if row.num_draft_tokens:
                    k = row.num_draft_tokens
                    accept = k if self.accept_fn is None else min(self.accept_fn(row), k)
                    drafts = row.input_ids[len(row.input_ids) - k :]
                    out = drafts[:accept] + [self.token_fn(row.rid, row.end - k + accept)]
                else:
                    assert n == 1
                    out = [self.token_fn(row.rid, row.start + row.sample_offsets[0] + 1)]
                if not row.num_draft_tokens:
                    self.last_sample[row.slot] = out[-1]
            tokens.append(out)
            lps.append([-0.5] * len(out) if row.params.logprobs else [])
            k = row.params.top_logprobs
            tops.append([[(t, -0.5)] + [(0, -9.0)] * (k - 1) for t in out] if k else [])
            pl = row.prompt_logprobs
            scores.append([-1.0] * len(pl.targets) if pl is not None else [])
        self.copies += [op for op in plan.block_ops if isinstance(op, CopyBlock)]
        return _Handle(self, StepResult(plan.step_id, tokens, lps, tops, scores))

    def overlapped(self) -> bool:
        """Whether every step's result was taken only after the next step was launched."""
        launched = [i for kind, i in self.events if kind == "execute"]
        taken = {i: n for n, (kind, i) in enumerate(self.events) if kind == "result"}
        launch_at = {i: n for n, (kind, i) in enumerate(self.events) if kind == "execute"}
        return all(taken[a] > launch_at[b] for a, b in zip(launched, launched[1:]))


@dataclass
class _Handle:
    runner: ScriptedRunner
    value: StepResult

    def result(self) -> StepResult:
        self.runner.events.append(("result", self.value.step_id))
        return self.value
