"""Penalties from per-slot token counts on the device (the runner half of SamplingParams'
presence / frequency / repetition penalties).

Per slot the runner keeps `output_counts` ([slots, vocab] int32: how often each token occurs in
the sequence's output) and `prompt_seen` ([slots, vocab] bool: which tokens its prompt has).
A `SlotEntry` sets them once when a sequence takes the slot (its prompt and any earlier output,
or a copy of its fork parent's slot); each step then adds the row's accepted samples inside the
step, on the device (`count`), so a penalised row never waits for its result on the host and
overlaps like any other. The logits transform is `radixrt.executor.sampler.apply_penalties`'s,
operation for operation (equal floats): OpenAI presence / frequency penalties on output
tokens, HF's repetition penalty on prompt + output tokens.

A verify row's position j is penalised with drafts 0..j-1 counted too (the tokens before it if
they are accepted), so each position's distribution is exactly plain decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixrt.executor.inputs import StepLayout
from radixrt.executor.runner_features import DeviceDrafts, RunnerFeature, StepContext
from radixrt.plan import SlotEntry, StepPlan

if TYPE_CHECKING:
    from radixrt.executor.result import StepOutputs


class SlotPenalties(RunnerFeature):
    """The per-slot counts (device) and which slots penalise (host); a runner feature
    (`radixrt.executor.runner_features`)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.output_counts = torch.zeros((num_slots, vocab_size), dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros((num_slots, vocab_size), dtype=torch.bool, device=device)
        self.active = [False] * num_slots  # the slot's sequence has penalties

    @staticmethod
    def bytes_needed(num_slots: int, vocab_size: int) -> int:
        """Device memory of the counts (allocated before the KV pool is sized)."""
        return num_slots * vocab_size * (4 + 1)

    # ---- hooks ----
    def on_slots(self, entries: list[SlotEntry]) -> None:
        self.enter(entries)

    def on_logits(self, ctx: StepContext, logits: torch.Tensor) -> None:
        samples = self.penalised(ctx.layout)
        if samples:
            self.apply(logits, ctx.plan, ctx.layout, samples, ctx.drafted)

    def after_sample(self, ctx: StepContext, logits: torch.Tensor, out: StepOutputs) -> None:
        if any(self.active[s] for s in ctx.layout.slots.tolist()):
            self.count(ctx.layout, out.tokens, ctx.drafting or [], out.num_accepted)

    # ---- the counts ----
    def enter(self, entries: Sequence[SlotEntry]) -> None:
        """Apply a plan's slot entries: copies read the slots as they were before any entry
        of the plan; then each penalised entry's tokens are counted (mutates the slots)."""
        if not entries:
            return
        copied = {}
        for e in entries:
            if e.copy_from is not None and e.params.has_penalties:
                src = e.copy_from
                copied[e.slot] = (self.output_counts[src].clone(), self.prompt_seen[src].clone())
        for e in entries:
            self.active[e.slot] = e.params.has_penalties
            if not e.params.has_penalties:
                continue
            s = e.slot
            if s in copied:
                self.output_counts[s].copy_(copied[s][0])
                self.prompt_seen[s].copy_(copied[s][1])
            else:
                self.output_counts[s].zero_()
                self.prompt_seen[s].zero_()
            if e.prompt_ids:
                self.prompt_seen[s, _ids(e.prompt_ids, self.device)] = True
            if e.output_ids:
                ids = _ids(e.output_ids, self.device)
                self.output_counts[s].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def penalised(self, layout: StepLayout) -> list[int]:
        """The step's samples whose slot penalises."""
        return [i for i, p in enumerate(layout.sample_params) if p.has_penalties]

    def apply(
        self,
        logits: torch.Tensor,  # [S, V] float32, modified in place
        plan: StepPlan,
        layout: StepLayout,
        samples: list[int],  # `penalised(layout)`, non-empty
        drafted: DeviceDrafts | None = None,
    ) -> None:
        """Penalise the listed samples from their slots' counts (+ the drafts before each
        verify position; host drafts from the plan, the draft model's from `drafted`)."""
        dev = self.device
        rows = layout.sample_rows[samples]
        slots = torch.from_numpy(layout.slots[rows]).to(dev, non_blocking=True)
        counts = self.output_counts[slots]  # [P, V] int32
        self._count_drafts(counts, plan, layout, samples, drafted)
        params = [layout.sample_params[s] for s in samples]
        every = len(samples) == logits.shape[0]  # (samples ascending: all of them, in order)
        index = None if every else torch.tensor(samples).to(dev, non_blocking=True)
        sub = logits if index is None else logits[index]
        if any(p.repetition_penalty != 1.0 for p in params):
            rep = _col([p.repetition_penalty for p in params], dev)
            seen = (counts > 0) | self.prompt_seen[slots]
            # the old per-row `row / p` divides by a scalar, which CUDA computes as a product
            # with its float32 reciprocal (CPU divides): the same floats here
            up = sub * (1 / rep) if dev.type == "cuda" else sub / rep
            sub = torch.where(seen, torch.where(sub > 0, up, sub * rep), sub)
        # `x -= f * counts + p * (counts > 0)` as the reference computes it; a term whose
        # penalty is 0 on every row adds 0.0 there, so it is left out (the same floats)
        frequency = any(p.frequency_penalty != 0.0 for p in params)
        presence = any(p.presence_penalty != 0.0 for p in params)
        freq = _col([p.frequency_penalty for p in params], dev) if frequency else None
        pres = _col([p.presence_penalty for p in params], dev) if presence else None
        if freq is not None and pres is not None:
            sub -= freq * counts + pres * (counts > 0)
        elif freq is not None:
            sub -= freq * counts
        elif pres is not None:
            sub -= pres * (counts > 0)
        if index is not None:
            logits[index] = sub
        elif sub is not logits:
            logits.copy_(sub)

    @staticmethod
    def _count_drafts(
        counts: torch.Tensor,
        plan: StepPlan,
        layout: StepLayout,
        samples: list[int],
        drafted: DeviceDrafts | None,
    ) -> None:
        """Add to each verify position's counts the drafts before it (in place)."""
        device_row = {} if drafted is None else {i: a for a, i in enumerate(drafted.rows)}
        host_at, host_ids, dev_at, dev_rows, dev_pos = [], [], [], [], []
        for p, s in enumerate(samples):
            i = int(layout.sample_rows[s])
            j = s - int(layout.row_first_sample[i])  # the sample's position in its row
            if j == 0 or not plan.rows[i].num_draft_tokens:
                continue
            if i in device_row:
                dev_at += [p] * j
                dev_rows += [device_row[i]] * j
                dev_pos += range(j)
            else:
                drafts = plan.row_drafts(i)[:j]
                host_at += [p] * len(drafts)
                host_ids += drafts
        dev = counts.device
        if host_at:
            at, ids = _ids(host_at, dev), _ids(host_ids, dev)
            ones = torch.ones(len(host_at), dtype=counts.dtype, device=dev)
            counts.index_put_((at, ids), ones, accumulate=True)
        if dev_at:
            assert drafted is not None
            ids = drafted.token_ids[_ids(dev_rows, dev), _ids(dev_pos, dev)]
            at = _ids(dev_at, dev)
            ones = torch.ones(len(dev_at), dtype=counts.dtype, device=dev)
            counts.index_put_((at, ids), ones, accumulate=True)

    def count(
        self,
        layout: StepLayout,
        tokens: torch.Tensor,  # [S] int64: the step's samples (after verification)
        drafting: list[int],  # rows with drafts, in the order of num_accepted
        num_accepted: torch.Tensor | None,  # [len(drafting)] int64 (device)
    ) -> None:
        """Add each penalised row's accepted samples to its slot's counts (on the device, no
        host sync): a plain row's last sample; a verify row's first num_accepted + 1."""
        slots, index, weight_rows, weight_pos = [], [], [], []
        at = {i: a for a, i in enumerate(drafting)}
        counts_per_row = layout.num_samples
        for i in np.flatnonzero(counts_per_row).tolist():
            s = int(layout.slots[i])
            if not self.active[s]:
                continue
            first, n = int(layout.row_first_sample[i]), int(counts_per_row[i])
            if i in at:
                slots += [s] * n
                index += range(first, first + n)
                weight_rows += [at[i]] * n
                weight_pos += range(n)
            else:
                slots.append(s)
                index.append(first + n - 1)
                weight_rows.append(-1)
                weight_pos.append(0)
        if not slots:
            return
        dev = self.device
        ids = tokens[_ids(index, dev)]
        weights = torch.ones(len(slots), dtype=torch.int32, device=dev)
        if num_accepted is not None and any(r >= 0 for r in weight_rows):
            rows_t = _ids([max(r, 0) for r in weight_rows], dev)
            accepted = num_accepted[rows_t]
            keep = _ids(weight_pos, dev) <= accepted
            plain = _ids([r < 0 for r in weight_rows], dev).bool()
            weights = (keep | plain).to(torch.int32)
        self.output_counts.index_put_((_ids(slots, dev), ids), weights, accumulate=True)


def _ids(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _col(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1).to(device, non_blocking=True)
