"""The scheduler halves of features and the hooks the scheduler calls them at.

A feature (structured output, speculative decoding, n > 1 / beam-search groups, ...) is one
object with its own state that overrides some of the hooks below; the scheduler calls each hook
on the features that override it, in the order they were given, and nothing else of theirs.
A feature keeps its per-request state itself (a table keyed by the `Request`, which hashes by
identity), never on `Request`: a request that does not use a feature costs it at most a lookup
per hook, and `on_preempt` / `on_finish` tell it when to drop that state.

Hooks, in the order of one step:
- `on_add(req)`: a request (a group's parent) is queued; may raise ValueError (nothing queued).
- `before_schedule(ops)`: a step is being planned; `ops` collects block ops for its plan.
- `admissible(req)`: whether a waiting request may be admitted now.
- `before_rows(reqs)`: the requests that get rows this step, before their rows are made.
- `on_row(req, row, drafts, samples, tables)`: a plan row was made for `req`; the feature may
  add its side tables (drafts, a bitmask: `tables`, a `StepTables`) and say the row needs
  its result on the host.
- `on_row_result(req, row, result, i) -> bool`: a row's result for a running request; True:
  the feature consumed it (the row's tokens are not appended as output).
- `on_token(req, token) -> FinishReason | None`: an output token was appended.
- `after_update(changed)`: a result was applied; `changed` collects requests with news.
- `on_blocks_short(num_blocks, req) `: the pool lacks `num_blocks` with nothing else
  evictable, for `req` (None: no request's); the feature may make blocks evictable.
- `on_kv_lost(on_lost_path)`: a failed plan left some KV unknown; `on_lost_path(handle)`
  tells whether a radix path holds such KV, and the feature drops what rests on one.
- `restricts_drafts(req) -> bool` / `allowed_drafts(req, drafts) -> list[int]`: speculative
  decoding asks whether a feature checks `req`'s drafts (device drafts are then not made) and
  keeps only the longest prefix of `drafts` each such feature allows.
- `on_preempt(req)`: a sequence lost its KV and waits again (results in flight are dropped).
- `on_finish(req)`: a request (or a beam) finished, however (stop, abort, failure); it is in
  no queue anymore.
- `check_integrity()`: assert the feature's own invariants.

Speculative decoding is asked for drafts (`SpeculationFeature.drafts`), which is where the
rules between it and the other features are written; the other features' say in them comes
through `restricts_drafts` / `allowed_drafts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixrt.deltas import FinishReason
from radixrt.plan import BlockOp, PlanRow, StepPlan, StepResult, TokenBitmasks
from radixrt.scheduler.request import Request


@dataclass
class StepTables:
    """The side tables of the plan being made, keyed by id(row) until the rows are final."""

    drafts: dict[int, list[int]] = field(default_factory=dict)  # host drafts of a row
    device_drafts: set[int] = field(default_factory=set)  # rows the draft model drafts for
    masks: dict[int, bytes] = field(default_factory=dict)  # a row's grammar bitmasks

    def fill(self, plan: StepPlan) -> None:
        """Put the tables into `plan` (its rows final), by row index."""
        at = {id(r): i for i, r in enumerate(plan.rows)}
        plan.drafts = {at[k]: d for k, d in self.drafts.items() if k in at}
        plan.device_drafts = sorted(at[k] for k in self.device_drafts if k in at)
        masked = sorted((at[k], m) for k, m in self.masks.items() if k in at)
        if masked:
            plan.bitmasks = TokenBitmasks([i for i, _ in masked], b"".join(m for _, m in masked))


HOOKS = (
    "on_add",
    "before_schedule",
    "admissible",
    "before_rows",
    "on_row",
    "on_row_result",
    "on_token",
    "after_update",
    "on_blocks_short",
    "on_kv_lost",
    "restricts_drafts",
    "allowed_drafts",
    "on_preempt",
    "on_finish",
    "check_integrity",
)


class SchedulerFeature:
    """Base of a feature's scheduler half: every hook does nothing."""

    def on_add(self, req: Request) -> None:
        pass

    def before_schedule(self, ops: list[BlockOp]) -> None:
        pass

    def admissible(self, req: Request) -> bool:
        return True

    def before_rows(self, reqs: list[Request]) -> None:
        pass

    def on_row(
        self, req: Request, row: PlanRow, drafts: list[int], samples: bool, tables: StepTables
    ) -> None:
        pass

    def on_row_result(self, req: Request, row: PlanRow, result: StepResult, i: int) -> bool:
        return False

    def on_token(self, req: Request, token: int) -> FinishReason | None:
        return None

    def after_update(self, changed: list[Request]) -> None:
        pass

    def on_blocks_short(self, num_blocks: int, req: Request | None) -> None:
        pass

    def on_kv_lost(self, on_lost_path: Callable[[Any], bool]) -> None:
        pass

    def restricts_drafts(self, req: Request) -> bool:
        return False

    def allowed_drafts(self, req: Request, drafts: list[int]) -> list[int]:
        return drafts

    def on_preempt(self, req: Request) -> None:
        pass

    def on_finish(self, req: Request) -> None:
        pass

    def check_integrity(self) -> None:
        pass


class Hooks:
    """Per hook, the bound methods of the features that override it. The parts get this object
    (or its lists) in their constructors; its owner (the Scheduler) `bind`s the features, which
    refills the lists in place."""

    def __init__(self, features: list[SchedulerFeature] = ()) -> None:
        self.features: list[SchedulerFeature] = []
        for name in HOOKS:
            setattr(self, name, [])
        self.bind(list(features))

    def bind(self, features: list[SchedulerFeature]) -> None:
        self.features = features
        for name in HOOKS:
            base = getattr(SchedulerFeature, name)
            bound = [getattr(f, name) for f in features if getattr(type(f), name) is not base]
            getattr(self, name)[:] = bound

    # (attributes set above: one list of bound methods per name in HOOKS)
    on_add: list
    before_schedule: list
    admissible: list
    before_rows: list
    on_row: list
    on_row_result: list
    on_token: list
    after_update: list
    on_blocks_short: list
    on_kv_lost: list
    restricts_drafts: list
    allowed_drafts: list
    on_preempt: list
    on_finish: list
    check_integrity: list
