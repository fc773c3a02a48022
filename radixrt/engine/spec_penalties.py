"""Penalties at the k + 1 positions of a verify row: the sample at position j counts the
row's output so far plus drafts 0..j-1 (the tokens that precede it if they are accepted), so
each position's distribution is exactly the one plain decoding would penalise with."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixrt.engine.draft import DraftOutput
from radixrt.engine.inputs import StepLayout
from radixrt.plan import StepPlan


def penalty_output_ids(
    plan: StepPlan, layout: StepLayout, drafted: DraftOutput | None
) -> list[Sequence[int] | torch.Tensor]:
    """Per sample of the step: the output ids its penalties count (host lists; device
    tensors [n] int64 for positions after draft-model drafts, which stay on the device)."""
    out: list[Sequence[int] | torch.Tensor] = []
    device_row = {} if drafted is None else {i: a for a, i in enumerate(drafted.rows)}
    for s, i in enumerate(layout.sample_rows.tolist()):
        r = plan.rows[i]
        base = r.history[r.prompt_len :] if r.history else []
        j = s - int(layout.row_first_sample[i])  # the sample's position among the row's
        if not r.num_draft_tokens or j == 0 or not r.params.has_penalties:
            out.append(base)
        elif i in device_row:
            assert drafted is not None
            drafts = drafted.token_ids[device_row[i], :j]
            out.append(torch.cat([torch.tensor(base, dtype=torch.int64).to(drafts.device), drafts]))
        else:
            out.append(base + r.input_ids[len(r.input_ids) - r.num_draft_tokens :][:j])
    return out
