"""Rejection sampling (radixrt.executor.rejection): the verifier's output has the target's
joint distribution at two consecutive positions, and the chi-square test used for that has
the power to reject broken verifiers (accept-always; a rejected position sampled from p instead of
max(0, p - q)).

Model: a Markov target p(x1), p(x2 | x1) and a different Markov draft q over V = 16 tokens.
One speculative step with k = 2 drafts d1 ~ q(.), d2 ~ q(. | d1) yields t1 (and t2 when d1
was accepted); rows that got one token run a second step from context t1, whose first token
is t2. The 256 joint cells (t1, t2) are compared to p(x1) p(x2 | x1) with a chi-square test
at ALPHA. N rows run as one batch (vectorised, no per-sample Python loop).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from radixrt.executor.rejection import RejectionResult, rejection_sample, row_noise
from radixrt.sampling import SamplingParams

V = 16
N = 40_000
ALPHA = 1e-3  # the correct verifier fails with this probability (fixed seeds: deterministic)


def _markov(gen: torch.Generator, concentration: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(first [V], transition [V, V]) with Dirichlet(concentration) rows."""
    dist = torch.distributions.Dirichlet(torch.full((V,), concentration))
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return dist.sample(), dist.sample((V,))


def _accept_always(p, q, d, n, u, e) -> RejectionResult:
    return rejection_sample(p, q, d, n, torch.zeros_like(u), e)


def _no_residual(p, q, d, n, u, e) -> RejectionResult:
    """Accepts correctly but samples a rejected position from p, not max(0, p - q)."""
    good = rejection_sample(p, q, d, n, u, e)
    rows = torch.arange(p.shape[0])
    from_p = (p[rows, good.num_accepted] / e).argmax(dim=1)
    tokens = good.tokens.clone()
    tokens[rows, good.num_accepted] = from_p
    return RejectionResult(tokens, good.num_accepted)


def _run_two_positions(verifier, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Observed counts [V * V] of (t1, t2) over N rows and the expected counts."""
    p1, p_next = _markov(gen, 1.5)
    q1, q_next = _markov(gen, 1.5)

    def step(context: torch.Tensor | None) -> torch.Tensor:
        """One k = 2 verify step per row from `context` ([N] last token, None: start)."""
        qa = q1.expand(N, V) if context is None else q_next[context]
        pa = p1.expand(N, V) if context is None else p_next[context]
        d1 = torch.multinomial(qa, 1, generator=gen).squeeze(1)
        qb = q_next[d1]
        d2 = torch.multinomial(qb, 1, generator=gen).squeeze(1)
        target = torch.stack([pa, p_next[d1], p_next[d2]], dim=1)  # [N, 3, V]
        draft = torch.stack([qa, qb], dim=1)
        drafts = torch.stack([d1, d2], dim=1)
        u = torch.rand((N, 2), generator=gen)
        e = torch.empty((N, V)).exponential_(generator=gen)
        res = verifier(target, draft, drafts, torch.full((N,), 2), u, e)
        return res.tokens, res.num_accepted

    tokens, accepted = step(None)
    t1 = tokens[:, 0]
    again, _ = step(t1)
    t2 = torch.where(accepted >= 1, tokens[:, 1], again[:, 0])
    observed = torch.bincount(t1 * V + t2, minlength=V * V).double()
    expected = (p1.unsqueeze(1) * p_next).reshape(-1).double() * N
    return observed, expected


def _p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    # pool cells expected below 5 into one (the chi-square approximation needs >= 5)
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    if not small.any():
        obs, exp = observed, expected
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def test_joint_distribution_matches_target():
    observed, expected = _run_two_positions(rejection_sample, torch.Generator().manual_seed(1))
    assert _p_value(observed, expected) > ALPHA


@pytest.mark.parametrize("broken", [_accept_always, _no_residual])
def test_chi_square_rejects_broken_verifier(broken):
    observed, expected = _run_two_positions(broken, torch.Generator().manual_seed(1))
    assert _p_value(observed, expected) < ALPHA


def test_ragged_rows_and_bonus():
    """Row 0: 1 draft, accepted (p = q one-hot) -> bonus from p[1]; row 1: 2 drafts, the
    first impossible under p -> rejected, residual sample at position 0."""
    p = torch.zeros(2, 3, 4)
    q = torch.zeros(2, 2, 4)
    p[0, 0, 2] = 1
    q[0, 0, 2] = 1
    p[0, 1, 3] = 1
    p[0, 2, 0] = 1  # past row 0's drafts: never read
    q[0, 1] = 0.25
    p[1, :, 1] = 1
    q[1, :, 0] = 1
    drafts = torch.tensor([[2, 0], [0, 0]])
    res = rejection_sample(p, q, drafts, torch.tensor([1, 2]), torch.rand(2, 2), torch.ones(2, 4))
    assert res.num_accepted.tolist() == [1, 0]
    assert res.tokens[0, :2].tolist() == [2, 3]
    assert res.tokens[1, 0].item() == 1


def test_row_noise_seeded_rows_do_not_depend_on_the_batch():
    seeded = SamplingParams(temperature=1.0, seed=7)
    plain = SamplingParams(temperature=1.0)
    dev = torch.device("cpu")
    a = row_noise([seeded, plain], [3, 0], (5,), "uniform", 1, dev)
    b = row_noise([plain, plain, seeded], [0, 0, 3], (5,), "uniform", 1, dev)
    assert torch.equal(a[0], b[2])
    c = row_noise([seeded], [4], (5,), "uniform", 1, dev)
    assert not torch.equal(a[0], c[0])
