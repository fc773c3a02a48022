"""Sampling of a step's rows on the device: penalties, logit bias, grammar masks, sampling,
verification of drafts (exact match; rejection sampling for the draft model's drafts on
non-greedy rows), and each row's last accepted sample kept in its slot for the next step.

`RowSampling` is a mixin of `radixrt.engine.runner.ModelRunner` (it uses the runner's
`device`, `last_tokens` and `_generator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixrt.engine.draft_verify import verify_stochastic
from radixrt.engine.inputs import StepLayout
from radixrt.engine.result import StepOutputs
from radixrt.engine.sampler import apply_logit_bias, apply_min_tokens, apply_penalties, sample
from radixrt.engine.spec_penalties import penalty_output_ids
from radixrt.plan import StepPlan

if TYPE_CHECKING:
    from radixrt.engine.draft import DraftOutput


class RowSampling:
    device: torch.device
    last_tokens: torch.Tensor  # [slots] each row's last sample, on the device
    eos_token_ids: Sequence[int]  # masked before a request's min_tokens
    _generator: torch.Generator | None

    def _sample(
        self,
        plan: StepPlan,
        layout: StepLayout,
        logits: torch.Tensor | None,
        drafted: DraftOutput | None = None,
    ) -> StepOutputs:
        """Sample every listed position, verify drafts (`drafted`: the draft model's, by
        rejection sampling for non-greedy rows), keep each row's last accepted sample in its
        slot on the device."""
        out = StepOutputs()
        if logits is None:
            return out
        params = layout.sample_params
        penalties = bias = want_logprobs = min_tokens = False
        top_k = 0
        for p in params:  # one pass over the samples' parameters
            penalties = penalties or p.has_penalties
            bias = bias or bool(p.logit_bias)
            min_tokens = min_tokens or p.min_tokens > 0
            want_logprobs = want_logprobs or p.logprobs
            top_k = max(top_k, p.top_logprobs)
        if penalties:
            rows = [plan.rows[i] for i in layout.sample_rows.tolist()]
            apply_penalties(
                logits,
                params,
                [r.history[: r.prompt_len] if r.history else [] for r in rows],
                penalty_output_ids(plan, layout, drafted),  # + drafts before each position
            )
        if bias:
            apply_logit_bias(logits, params)  # log-probs are of the distribution sampled from
        if min_tokens:  # EOS / stop ids cannot end a request before its min_tokens
            apply_min_tokens(logits, params, layout.seed_offsets, self.eos_token_ids)
        masked, drafting = [], []
        for i, r in enumerate(plan.rows):
            if r.token_bitmask is not None:
                masked.append(i)
            if r.num_draft_tokens:
                drafting.append(i)
        if masked:  # structured output: before temperature / top-k / top-p
            self._apply_grammar_masks(plan, layout, logits, masked)
        sampled = sample(
            logits, params, layout.seed_offsets, want_logprobs, top_k, generator=self._generator
        )
        tokens = sampled.token_ids
        out.tokens, out.logprobs = tokens, sampled.logprobs
        out.top_ids, out.top_logprobs = sampled.top_ids, sampled.top_logprobs
        if drafting:
            out.num_accepted = self._verify(plan, layout, tokens, drafting, drafted)
        if drafted is not None:
            stochastic = verify_stochastic(
                plan, layout, logits, tokens, out, drafted, drafting, self._generator
            )
            if stochastic and want_logprobs:  # rejection replaced some tokens
                lps = torch.log_softmax(logits, dim=-1)
                out.logprobs = lps.gather(1, tokens.unsqueeze(1)).squeeze(1)
        self._keep_last_samples(layout, tokens, drafting)
        return out

    def _keep_last_samples(
        self, layout: StepLayout, tokens: torch.Tensor, drafting: list[int]
    ) -> None:
        """Each sampling row's last sample into its slot of `last_tokens`. Rows with drafts
        are skipped: their last accepted sample is known once the result is on the host, and
        their next step feeds it from there."""
        dev = self.device
        if layout.one_sample_per_row and not drafting:  # row i's sample is tokens[i]
            if dev.type == "cpu":  # one numpy op (cheaper than three torch ops here)
                self.last_tokens.numpy()[layout.slots] = tokens.numpy()
                return
            slots = torch.from_numpy(layout.slots).to(dev, non_blocking=True)
            self.last_tokens.index_copy_(0, slots, tokens)
            return
        samples = layout.num_samples
        last = layout.row_first_sample + samples - 1  # [R]: the row's last sample
        skip = set(drafting)
        keep = [i for i in np.flatnonzero(samples).tolist() if i not in skip]
        if keep:
            slots = torch.from_numpy(layout.slots[keep]).to(dev, non_blocking=True)
            src = torch.from_numpy(last[keep]).to(dev, non_blocking=True)
            self.last_tokens.index_copy_(0, slots, tokens[src])

    @staticmethod
    def _apply_grammar_masks(
        plan: StepPlan, layout: StepLayout, logits: torch.Tensor, rows: list[int]
    ) -> None:
        """Mask every sample of each constrained row (a verify row: one mask per sample)."""
        from radixrt.engine.grammar_masks import apply_token_bitmasks

        masks, index = [], []
        for i in rows:
            bitmask, count = plan.rows[i].token_bitmask, int(layout.num_samples[i])
            width = len(bitmask) // count
            assert width * count == len(bitmask), "a masked row carries one mask per sample"
            first = int(layout.row_first_sample[i])
            masks += [bitmask[j * width : (j + 1) * width] for j in range(count)]
            index += range(first, first + count)
        apply_token_bitmasks(logits, masks, index)

    def _verify(
        self,
        plan: StepPlan,
        layout: StepLayout,
        tokens: torch.Tensor,
        rows: list[int],
        drafted: DraftOutput | None = None,
    ) -> torch.Tensor:
        """Accepted drafts per drafting row [len(rows)] int64 (device): the longest prefix of
        its drafts equal to the samples at the positions before them. A sample made with the
        row's own sampling parameters that equals a deterministic draft accepts it, so the
        output has exactly the distribution of non-speculative sampling."""
        k = max(plan.rows[i].num_draft_tokens for i in rows)
        drafts = np.zeros((len(rows), k), dtype=np.int64)
        index = np.zeros((len(rows), k), dtype=np.int64)
        valid = np.zeros((len(rows), k), dtype=bool)
        for j, i in enumerate(rows):
            r = plan.rows[i]
            n = r.num_draft_tokens
            assert layout.num_samples[i] == n + 1, "a drafting row samples at its k + 1 last tokens"
            drafts[j, :n] = r.input_ids[len(r.input_ids) - n :]
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
