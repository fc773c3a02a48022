"""Verification of the draft model's drafts for non-greedy rows: rejection sampling over the
target's distribution at each of the row's k + 1 positions (`radixrt.executor.rejection`).
Greedy rows need none of this: their drafts are verified by exact match (`RowSampler.verify`),
which is what rejection sampling reduces to for one-hot p and q."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixrt.executor.inputs import StepLayout
from radixrt.executor.rejection import rejection_sample, row_noise
from radixrt.executor.result import StepOutputs
from radixrt.executor.runner_features import DeviceDrafts
from radixrt.executor.sampler import sampling_probs
from radixrt.plan import StepPlan

ACCEPT_SALT = 2_000  # noise salts of a seeded row (the draft's are DRAFT_SALT + j)
FINAL_SALT = 3_000


@dataclass
class DraftOutput(DeviceDrafts):
    """The draft model's drafts of one step's `device_drafts` rows, with the distributions
    they were sampled from (what rejection sampling needs)."""

    probs: torch.Tensor  # [R, k, V] float32: q of each draft (0 past num_drafts)


def verify_stochastic(
    plan: StepPlan,
    layout: StepLayout,
    logits: torch.Tensor,  # [S, V] float32: the step's sample logits, penalties/bias applied
    tokens: torch.Tensor,  # [S] int64: the step's samples; rejection rows' are overwritten
    out: StepOutputs,  # out.num_accepted [len(drafting)] is overwritten for those rows
    drafted: DraftOutput,
    drafting: list[int],  # plan rows with drafts, in the order of out.num_accepted
    generator: torch.Generator | None = None,
) -> bool:
    """Rejection-sample the non-greedy rows of `drafted` in place; True if there were any.
    p at a row's position m is `sampling_probs` of its logits there (temperature, top-k/p,
    min-p: exactly what plain sampling draws from)."""
    firsts = layout.row_first_sample
    pick = [
        a for a, i in enumerate(drafted.rows) if not layout.sample_params[int(firsts[i])].greedy
    ]
    if not pick:
        return False
    assert out.num_accepted is not None
    dev = logits.device
    rows = [drafted.rows[a] for a in pick]
    n = np.asarray([drafted.num_drafts[a] for a in pick], dtype=np.int64)
    k = drafted.token_ids.shape[1]
    first = layout.row_first_sample[rows]  # [R]
    # sample index of position m of each row (past the row's n + 1 positions: its last)
    index = first[:, None] + np.minimum(np.arange(k + 1)[None, :], n[:, None])
    index_d = torch.from_numpy(index).to(dev, non_blocking=True)
    params = [layout.sample_params[int(f)] for f in first]
    target = sampling_probs(logits[index_d.reshape(-1)], np.repeat(params, k + 1).tolist())
    target = target.view(len(rows), k + 1, -1)
    pick_d = torch.tensor(pick, dtype=torch.int64).to(dev, non_blocking=True)
    steps = [plan.rows[i].num_output_before for i in rows]
    vocab = logits.shape[1]
    res = rejection_sample(
        target,
        drafted.probs[pick_d],
        drafted.token_ids[pick_d],
        torch.from_numpy(n).to(dev, non_blocking=True),
        row_noise(params, steps, (k,), "uniform", ACCEPT_SALT, dev, generator),
        row_noise(params, steps, (vocab,), "exponential", FINAL_SALT, dev, generator),
    )
    # write back: the row's n + 1 sample positions get the rejection tokens
    valid = np.arange(k + 1)[None, :] <= n[:, None]
    flat = torch.from_numpy(index[valid]).to(dev, non_blocking=True)
    src = torch.from_numpy(np.flatnonzero(valid)).to(dev, non_blocking=True)
    tokens[flat] = res.tokens.reshape(-1)[src]  # gathers, no boolean mask: no host sync
    at = {i: j for j, i in enumerate(drafting)}
    dst = torch.tensor([at[i] for i in rows], dtype=torch.int64).to(dev, non_blocking=True)
    out.num_accepted[dst] = res.num_accepted
    return True
