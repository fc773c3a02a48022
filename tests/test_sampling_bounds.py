"""Sampling at the bounds of every accepted value: temperatures below GREEDY_TEMPERATURE and
top_k 1 are the argmax, extreme top_p / min_p keep the top token, huge temperatures rank by
logit, penalties and logit bias at their bounds keep the logits finite; both the CPU path
(`sample`) and the filter the GPU path uses (`sampling_probs`). And the ranges: each bound is
accepted, a value past it is a ValueError naming the field and the range."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch

from radixrt.errors import RequestValueError
from radixrt.executor.sampler import apply_logit_bias, apply_penalties, sample, sampling_probs
from radixrt.sampling import (
    GREEDY_TEMPERATURE,
    LENGTH_PENALTY_RANGE,
    LOGIT_BIAS_RANGE,
    MAX_INT,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    PENALTY_RANGE,
    BeamSearchParams,
    SamplingParams,
)

VOCAB = 64
MASKED = 5  # a token masked out (-inf, as a grammar does): never drawn


def logits_rows(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    logits[:, MASKED] = float("-inf")
    return logits


def draws(logits: torch.Tensor, params: list[SamplingParams], n: int = 40) -> torch.Tensor:
    """[n, S]: n draws per row (a new seed offset each: seeded rows vary too)."""
    return torch.stack([sample(logits, params, [i] * len(params)).token_ids for i in range(n)])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=1e-38, top_k=1),
        dict(temperature=1e-300),
        dict(temperature=1e308, top_p=1e-300),
        dict(temperature=GREEDY_TEMPERATURE / 2),
        dict(temperature=1e30, top_k=1),
        dict(temperature=1e308, min_p=1.0),
        dict(temperature=sys.float_info.max, top_p=1e-300, min_p=1e-300, seed=3),
        dict(temperature=GREEDY_TEMPERATURE, top_p=1e-300),
        dict(temperature=1.0, min_p=1.0),
    ],
    ids=str,
)
def test_extreme_values_give_the_argmax(kwargs):
    """The reported findings and their relatives: each of these keeps only the most likely
    token (to exact arithmetic), so every draw is the argmax."""
    logits = logits_rows(4)
    params = [SamplingParams(**kwargs)] * 4
    want = logits.argmax(dim=-1)
    got = draws(logits, params)
    assert (got == want).all(), (got[:, 0].unique(), want)
    probs = sampling_probs(logits, params)  # what the GPU path's filter keeps
    if not params[0].greedy:
        assert torch.equal(probs.argmax(dim=-1), want)
        assert torch.allclose(probs.gather(1, want.unsqueeze(1)), torch.ones(4, 1))


def test_greedy_means_below_the_epsilon_or_top_k_1():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE * 0.999).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    assert SamplingParams(temperature=1e6, top_k=1).greedy
    assert not SamplingParams(temperature=1e6, top_k=2).greedy


def test_huge_temperature_is_uniform_over_the_filtered_set_ranked_by_logit():
    """T = 1e308 (above float32's range): the uniform limit; top_k still keeps the k largest
    logits (not k arbitrary tokens among equal probabilities), a masked token stays out."""
    logits = logits_rows(1)
    top3 = set(logits[0].topk(3).indices.tolist())
    for p in (SamplingParams(temperature=1e308, top_k=3), SamplingParams(temperature=1e308)):
        probs = sampling_probs(logits, [p])[0]
        assert torch.isfinite(probs).all() and probs[MASKED] == 0
        kept = set(torch.nonzero(probs)[:, 0].tolist())
        assert kept == (top3 if p.top_k else set(range(VOCAB)) - {MASKED})
        assert torch.allclose(probs[list(kept)], torch.full((len(kept),), 1 / len(kept)))
        got = set(draws(logits, [p], 200)[:, 0].tolist())
        assert got <= kept and len(got) > 1


TEMPERATURES = [0.0, 1e-300, GREEDY_TEMPERATURE, 0.7, 1e30, sys.float_info.max]
FILTERS = [
    dict(),
    dict(top_p=1e-300),
    dict(top_p=0.5),
    dict(top_k=2),
    dict(top_k=MAX_INT),
    dict(min_p=1e-300),
    dict(min_p=0.5),
    dict(min_p=1.0),
    dict(top_k=7, top_p=0.9, min_p=0.1),
]
EXTRAS = [
    dict(),
    dict(repetition_penalty=MIN_REPETITION_PENALTY, presence_penalty=-PENALTY_RANGE),
    dict(repetition_penalty=MAX_REPETITION_PENALTY, frequency_penalty=PENALTY_RANGE),
    dict(logit_bias={3: LOGIT_BIAS_RANGE, 4: -LOGIT_BIAS_RANGE, MASKED: LOGIT_BIAS_RANGE}),
    dict(seed=2**63 - 1),
]


@pytest.mark.parametrize("extra", EXTRAS, ids=str)
def test_every_bound_combination_is_sane(extra):
    """Every temperature x filter at the bounds, with penalties / bias / seed at theirs: the
    logits stay finite (bar the mask), the distribution is finite and sums to 1, and each draw
    is a token that distribution allows, never the masked one; the top token is always in."""
    params = [SamplingParams(temperature=t, **f, **extra) for t in TEMPERATURES for f in FILTERS]
    logits = logits_rows(len(params), seed=1)
    history = [[3, 4, 7, 7, 9]] * len(params)
    apply_penalties(logits, params, history, [[7, 9, 9, 11]] * len(params))
    apply_logit_bias(logits, params)
    assert torch.isfinite(torch.cat([logits[:, :MASKED], logits[:, MASKED + 1 :]], 1)).all()
    assert (logits[:, MASKED] == float("-inf")).all()
    probs = sampling_probs(logits, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(dim=-1), torch.ones(len(params)))
    top = logits.argmax(dim=-1)
    got = draws(logits, params, 30)
    for i, p in enumerate(params):
        assert (got[:, i] != MASKED).all(), p
        if p.greedy:
            assert (got[:, i] == top[i]).all(), p
            continue
        assert probs[i, top[i]] > 0, p
        assert (probs[i, got[:, i]] > 0).all(), p
        if p.top_k is not None and p.top_k < VOCAB:
            allowed = set(logits[i].topk(p.top_k).indices.tolist())
            assert set(got[:, i].tolist()) <= allowed, p


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        (dict(repetition_penalty=1e-300), "repetition_penalty", "in [0.01, 100]"),
        (dict(repetition_penalty=100.5), "repetition_penalty", "in [0.01, 100]"),
        (dict(presence_penalty=-2.5), "presence_penalty", "in [-2, 2]"),
        (dict(frequency_penalty=math.inf), "frequency_penalty", "in [-2, 2]"),
        (dict(temperature=math.inf), "temperature", ">= 0"),
        (dict(top_p=1e-330), "top_p", "in (0, 1]"),  # 0.0 once parsed
    ],
)
def test_sampling_values_past_a_bound_name_the_field_and_range(kwargs, field, allowed):
    with pytest.raises(RequestValueError, match=rf"invalid {field}=.*{re.escape(allowed)}") as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_sampling_bounds_are_accepted():
    SamplingParams(
        temperature=sys.float_info.max,
        top_p=5e-324,
        min_p=1.0,
        repetition_penalty=MIN_REPETITION_PENALTY,
        presence_penalty=PENALTY_RANGE,
        frequency_penalty=-PENALTY_RANGE,
        logit_bias={0: -LOGIT_BIAS_RANGE},
        seed=2**63 - 1,
        top_k=MAX_INT,
        max_tokens=MAX_INT,
    )
    SamplingParams(repetition_penalty=MAX_REPETITION_PENALTY)


@pytest.mark.parametrize("penalty", [1000, -1000, 300, 10.5, -10.000001, math.nan])
def test_length_penalty_past_its_range_is_refused(penalty):
    """The reported 1000 / -1000 / 300 crashed the scheduler; now they are a ValueError naming
    length_penalty and its range (the HTTP layer answers 400 with it)."""
    with pytest.raises(ValueError, match=r"invalid length_penalty=.*in \[-10, 10\]"):
        BeamSearchParams(beam_width=2, max_tokens=32, length_penalty=penalty)


def test_beam_bounds():
    for penalty in (-LENGTH_PENALTY_RANGE, 0, LENGTH_PENALTY_RANGE):
        BeamSearchParams(beam_width=2, max_tokens=MAX_INT, length_penalty=penalty)
    with pytest.raises(ValueError, match=rf"invalid max_tokens=.*\[1, {MAX_INT}\]"):
        BeamSearchParams(max_tokens=MAX_INT + 1)
