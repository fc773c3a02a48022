"""The runner halves of features and the hooks the ModelRunner calls them at.

A runner feature owns its device state (a draft model and its KV pool, per-slot penalty
counts) and overrides some hooks; the runner calls every feature at each hook in the order of
`ModelRunner.features` and contains no per-feature branches. Hooks, in the order of a step:

- `on_slots(entries)`: a plan's `SlotEntry`s, before anything else of the step (per-slot state).
- `on_block_copy(op)`: a copy-on-write `CopyBlock` the runner ran on its pool (a feature with
  its own pool indexed by the same block ids copies too).
- `before_forward(ctx)`: after block ops, before the target's forward; may set
  `ctx.input_writes` (token ids written into the step's inputs on the device) and
  `ctx.drafted` (`DeviceDrafts` of `plan.device_drafts` rows).
- `after_forward(ctx, fb)`: after the target's forward (`fb`: its ForwardBatch; None when a
  CUDA graph ran).
- `on_logits(ctx, logits)`: the sample logits [S, V] float32, before logit bias, min-tokens
  masks, grammar masks and sampling; may modify them in place.
- `after_sample(ctx, logits, out)`: after sampling and exact-match verification; may replace
  tokens and accepted counts in `out` (then later features see the final ones).

The rules between features are this order, fixed in `ModelRunner.__init__` (draft model first,
then penalties): the draft model's drafts are the verify rows' inputs and the penalties count
them before each verify position (`on_logits` reads `ctx.drafted`); rejection sampling of
draft-model drafts replaces samples before penalties count the accepted ones (`after_sample`).
Init-time hooks: `kv_bytes_per_block(block_size)` (device memory per KV block beside the
target's, counted when the pool is sized) and `on_pool(num_blocks, block_size, scratch_block)`
(the pool exists; `scratch_block`: the decode CUDA graphs', None without graphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixrt.executor.inputs import StepLayout
from radixrt.plan import CopyBlock, SlotEntry, StepPlan

if TYPE_CHECKING:
    from radixrt.attention.forward_batch import ForwardBatch
    from radixrt.executor.result import StepOutputs


@dataclass
class DeviceDrafts:
    """Draft tokens a feature made on the device for some of a step's rows: the verify rows'
    inputs (written through `flat_index`) and what verification and penalties read."""

    rows: list[int]  # plan row index of each drafting row
    num_drafts: list[int]  # [R] drafts per row (1..k)
    token_ids: torch.Tensor  # [R, k] int64: drafts (0 past num_drafts)
    flat_index: torch.Tensor  # [sum num_drafts] int64: the drafts' token index in the target
    # step's flat inputs, row-major


@dataclass
class StepContext:
    """One step as the features see it (read-only but for the fields the hooks fill)."""

    plan: StepPlan
    layout: StepLayout
    use_cuda_graph: bool
    input_writes: tuple[torch.Tensor, torch.Tensor] | None = None  # (flat token index [N]
    # int64, token ids [N] int64), device: written into the step's input ids
    drafted: DeviceDrafts | None = None  # a feature's device drafts (the draft model's)
    drafting: list[int] | None = None  # plan rows with drafts (the order of num_accepted)


class RunnerFeature:
    """Base of a feature's runner half: every hook does nothing."""

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0

    def on_pool(self, num_blocks: int, block_size: int, scratch_block: int | None) -> None:
        pass

    def on_slots(self, entries: list[SlotEntry]) -> None:
        pass

    def on_block_copy(self, op: CopyBlock) -> None:
        pass

    def before_forward(self, ctx: StepContext) -> None:
        pass

    def after_forward(self, ctx: StepContext, fb: ForwardBatch | None) -> None:
        pass

    def on_logits(self, ctx: StepContext, logits: torch.Tensor) -> None:
        pass

    def after_sample(self, ctx: StepContext, logits: torch.Tensor, out: StepOutputs) -> None:
        pass
