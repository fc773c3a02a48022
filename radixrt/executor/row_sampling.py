"""Sampling of a step's rows on the device: the features' logits hooks (penalties), logit
bias, min-tokens masks, grammar masks, sampling, verification of drafts (exact match; the draft
model's after-sample hook verifies its drafts on non-greedy rows by rejection sampling), and
each row's last accepted sample kept in its slot for the next step.

`RowSampler` is the `radixrt.executor.runner.ModelRunner`'s sampling component: the runner
builds it with the device, its slot state, its features (in hook order), the EOS ids and the
sampling generator, and calls `sample` once per step after the forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixrt.executor.inputs import StepLayout
from radixrt.executor.result import StepOutputs
from radixrt.executor.runner_features import RunnerFeature, StepContext
from radixrt.executor.sampler import apply_logit_bias, apply_min_tokens
from radixrt.executor.sampler import sample as sample_logits
from radixrt.executor.slots import SlotState
from radixrt.plan import StepPlan


class RowSampler:
    """Samples a step's rows on `device`. Of the slot state it writes only
    `slots.last_tokens` (each row's last accepted sample); the step's logits are modified in
    place (hooks, bias, masks)."""

    def __init__(
        self,
        device: torch.device,
        slots: SlotState,
        features: Sequence[RunnerFeature],
        eos_token_ids: Sequence[int],
        generator: torch.Generator | None,
    ) -> None:
        """`slots`: the runner's slot state (last samples on the device); `features`: the
        runner's features in hook order; `eos_token_ids`: masked before a request's
        min_tokens; `generator`: the sampling noise (None: torch's default generator)."""
        self.device = device
        self.slots = slots
        self.features = features
        self.eos_token_ids = tuple(eos_token_ids)
        self.generator = generator

    def sample(self, ctx: StepContext, logits: torch.Tensor | None) -> StepOutputs:
        """Sample every listed position, verify drafts, keep each row's last accepted sample
        in its slot on the device; the features' `on_logits` / `after_sample` hooks run
        around it (see radixrt.executor.runner_features)."""
        out = StepOutputs()
        if logits is None:
            return out
        plan, layout = ctx.plan, ctx.layout
        params = layout.sample_params
        bias = want_logprobs = min_tokens = False
        top_k = 0
        for p in params:  # one pass over the samples' parameters
            bias = bias or bool(p.logit_bias)
            min_tokens = min_tokens or p.min_tokens > 0
            want_logprobs = want_logprobs or p.logprobs
            top_k = max(top_k, p.top_logprobs)
        ctx.drafting = [i for i, r in enumerate(plan.rows) if r.num_draft_tokens]
        for f in self.features:
            f.on_logits(ctx, logits)
        if bias:
            apply_logit_bias(logits, params)  # log-probs are of the distribution sampled from
        if min_tokens:  # EOS / stop ids cannot end a request before its min_tokens
            apply_min_tokens(logits, params, layout.seed_offsets, self.eos_token_ids)
        if plan.bitmasks is not None:  # structured output: before temperature / top-k / top-p
            self._apply_grammar_masks(plan, layout, logits)
        sampled = sample_logits(
            logits, params, layout.seed_offsets, want_logprobs, top_k, generator=self.generator
        )
        tokens = sampled.token_ids
        out.tokens, out.logprobs = tokens, sampled.logprobs
        out.top_ids, out.top_logprobs = sampled.top_ids, sampled.top_logprobs
        if ctx.drafting:
            out.num_accepted = self.verify(ctx, tokens)
        for f in self.features:
            f.after_sample(ctx, logits, out)
        self._keep_last_samples(layout, out.tokens, ctx.drafting)
        return out

    def _keep_last_samples(
        self, layout: StepLayout, tokens: torch.Tensor, drafting: list[int]
    ) -> None:
        """Each sampling row's last sample into its slot of `last_tokens`. Rows with drafts
        are skipped: their last accepted sample is known once the result is on the host, and
        their next step feeds it from there."""
        dev, last_tokens = self.device, self.slots.last_tokens
        if layout.one_sample_per_row and not drafting:  # row i's sample is tokens[i]
            if dev.type == "cpu":  # one numpy op (cheaper than three torch ops here)
                last_tokens.numpy()[layout.slots] = tokens.numpy()
                return
            slots = torch.from_numpy(layout.slots).to(dev, non_blocking=True)
            last_tokens.index_copy_(0, slots, tokens)
            return
        samples = layout.num_samples
        last = layout.row_first_sample + samples - 1  # [R]: the row's last sample
        skip = set(drafting)
        keep = [i for i in np.flatnonzero(samples).tolist() if i not in skip]
        if keep:
            slots = torch.from_numpy(layout.slots[keep]).to(dev, non_blocking=True)
            src = torch.from_numpy(last[keep]).to(dev, non_blocking=True)
            last_tokens.index_copy_(0, slots, tokens[src])

    @staticmethod
    def _apply_grammar_masks(plan: StepPlan, layout: StepLayout, logits: torch.Tensor) -> None:
        """Mask every sample of each constrained row (the plan's one bitmask array: a verify
        row has one mask per sample)."""
        from radixrt.executor.grammar_masks import apply_token_bitmasks

        masks = plan.bitmasks
        assert masks is not None
        index = []
        for i in masks.rows:
            first = int(layout.row_first_sample[i])
            index += range(first, first + int(layout.num_samples[i]))
        width = len(masks.data) // len(index)
        assert width * len(index) == len(masks.data), "one mask per sample of the masked rows"
        data = masks.data
        apply_token_bitmasks(
            logits, [data[j * width : (j + 1) * width] for j in range(len(index))], index
        )

    def verify(self, ctx: StepContext, tokens: torch.Tensor) -> torch.Tensor:
        """Accepted drafts per drafting row [len(ctx.drafting)] int64 (device): the longest
        prefix of its drafts equal to the samples at the positions before them (host drafts
        from the plan, the draft model's from `ctx.drafted`). A sample made with the row's own
        sampling parameters that equals a deterministic draft accepts it, so the output has
        exactly the distribution of non-speculative sampling."""
        plan, layout, rows, drafted = ctx.plan, ctx.layout, ctx.drafting, ctx.drafted
        assert rows
        k = max(plan.rows[i].num_draft_tokens for i in rows)
        drafts = np.zeros((len(rows), k), dtype=np.int64)
        index = np.zeros((len(rows), k), dtype=np.int64)
        valid = np.zeros((len(rows), k), dtype=bool)
        for j, i in enumerate(rows):
            n = plan.rows[i].num_draft_tokens
            assert layout.num_samples[i] == n + 1, "a drafting row samples at its k + 1 last tokens"
            host = plan.row_drafts(i)
            if host:
                drafts[j, :n] = host
            index[j, :n] = layout.row_first_sample[i] + np.arange(n)
            valid[j, :n] = True
        dev = self.device
        to_dev = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
        drafts_d = to_dev(drafts)
        if drafted is not None:  # the draft model's drafts (device): rows in drafted.rows
            at = {i: j for j, i in enumerate(rows)}
            width = min(k, drafted.token_ids.shape[1])
            dst = to_dev(np.asarray([at[i] for i in drafted.rows], dtype=np.int64))
            drafts_d[dst, :width] = drafted.token_ids[:, :width]
        match = (tokens[to_dev(index)] == drafts_d) & to_dev(valid)
        return match.to(torch.int64).cumprod(dim=1).sum(dim=1)
