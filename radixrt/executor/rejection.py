"""Rejection sampling for stochastic drafts (speculative decoding with a draft model).

Draft i of a row was sampled from the draft model's distribution q_i; the target's
distribution at that position is p_i (every sampling parameter applied). Draft i is accepted
with probability min(1, p_i(d_i) / q_i(d_i)) while all drafts before it were; the first
rejected position samples from norm(max(0, p_i - q_i)); a row whose drafts were all accepted
samples a bonus token from p_{k+1}. The tokens then have exactly the target's joint
distribution (Leviathan et al. 2023, Chen et al. 2023). Everything is vectorised over rows;
the noise comes in as tensors so that seeded rows can draw it from their own generators
(`row_noise`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from radixrt.sampling import SamplingParams


class RejectionResult(NamedTuple):
    tokens: torch.Tensor  # [R, k + 1] int64: the first num_accepted[r] + 1 are the output
    num_accepted: torch.Tensor  # [R] int64: accepted drafts per row, 0..num_drafts[r]


def rejection_sample(
    target_probs: torch.Tensor,  # [R, k + 1, V] float32: p at every position (rows sum to 1)
    draft_probs: torch.Tensor,  # [R, k, V] float32: q each draft was sampled from
    draft_ids: torch.Tensor,  # [R, k] int64: the drafts (padding past num_drafts)
    num_drafts: torch.Tensor,  # [R] int64: valid drafts per row, 1..k
    uniform: torch.Tensor,  # [R, k] float32 in [0, 1): acceptance noise
    exponential: torch.Tensor,  # [R, V] float32 > 0: Exp(1) noise of the one final sample
) -> RejectionResult:
    """See the module docstring. Reads its inputs only. Row r's output is
    tokens[r, :num_accepted[r] + 1]: its accepted drafts, then a residual sample (at the
    first rejection) or the bonus sample from target_probs[r, num_drafts[r]]."""
    num_rows, k, _ = draft_probs.shape
    assert target_probs.shape[:2] == (num_rows, k + 1)
    dev = target_probs.device
    ids = draft_ids.unsqueeze(2)  # [R, k, 1]
    p_d = target_probs[:, :k].gather(2, ids).squeeze(2)  # [R, k]
    q_d = draft_probs.gather(2, ids).squeeze(2)
    # u < p / q  <=>  u * q < p (q = 0 cannot have been drawn; p = 0 never accepts)
    accept = (uniform * q_d < p_d) & (p_d > 0)
    valid = torch.arange(k, device=dev).unsqueeze(0) < num_drafts.unsqueeze(1)
    num_accepted = (accept & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [R]
    rows = torch.arange(num_rows, device=dev)
    # The final sample's distribution: residual at a rejected draft, else p after the drafts.
    p_final = target_probs[rows, num_accepted]  # [R, V]
    rejected = num_accepted < num_drafts
    q_final = draft_probs[rows, num_accepted.clamp(max=k - 1)]
    residual = (p_final - q_final).clamp_(min=0.0)
    # p == q leaves no residual mass (a rejection then has probability 0): fall back to p.
    has_mass = residual.sum(dim=1, keepdim=True) > 0
    residual = torch.where(has_mass, residual, p_final)
    final = torch.where(rejected.unsqueeze(1), residual, p_final)
    # argmax(w / Exp(1)) samples proportionally to w: no renormalisation needed
    final_token = (final / exponential).argmax(dim=1)
    tokens = torch.cat([draft_ids, torch.zeros_like(draft_ids[:, :1])], dim=1)
    tokens[rows, num_accepted] = final_token
    return RejectionResult(tokens, num_accepted)


def row_noise(
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    shape: tuple[int, ...],
    kind: str,
    salt: int,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Noise [R, *shape] float32, `kind` 'uniform' or 'exponential'. Row r of a seeded
    request comes from its own generator seeded by (seed, steps[r], salt), so its tokens do
    not depend on the batch; other rows draw from `generator` (None: torch's default)."""
    out = torch.empty((len(params), *shape), device=device)
    draw = (lambda t, g: t.uniform_(generator=g)) if kind == "uniform" else None
    if draw is None:
        assert kind == "exponential", kind
        draw = lambda t, g: t.exponential_(generator=g)  # noqa: E731
    draw(out, generator)
    for r, p in enumerate(params):
        if p.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed((p.seed * 1_000_003 + steps[r] * 7919 + salt) % (2**63))
            draw(out[r], gen)
    if kind == "exponential":
        out.clamp_(min=1e-20)
    return out
