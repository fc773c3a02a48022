"""Sampling: filters keep only allowed tokens, seeds reproduce, penalties apply, and bad
parameters raise ValueError naming the field."""

from __future__ import annotations

import pytest
import torch

from radixrt import SamplingParams
from radixrt.errors import RequestValueError
from radixrt.executor.sampler import _argmax, apply_penalties, sample

VOCAB = 50


def draw(logits, params, n=300):
    """n samples per row (unseeded), as a [n, S] tensor."""
    return torch.stack([sample(logits, params, [0] * len(params)).token_ids for _ in range(n)])


def test_top_k_top_p_min_p_sets():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 2
    params = [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2),
    ]
    got = draw(logits, params)
    # top-k: the 5 largest logits
    allowed_k = set(logits[0].topk(5).indices.tolist())
    assert set(got[:, 0].tolist()) <= allowed_k
    assert len(set(got[:, 0].tolist())) > 1
    # top-p: smallest prefix of sorted probs whose mass before each token is < p
    probs = torch.softmax(logits[1] / 0.7, -1)
    sp, order = probs.sort(descending=True)
    keep = (sp.cumsum(0) - sp) < 0.6
    assert set(got[:, 1].tolist()) <= set(order[keep].tolist())
    # min-p: prob >= 0.2 * max prob
    probs = torch.softmax(logits[2], -1)
    allowed_min_p = set(torch.nonzero(probs >= 0.2 * probs.max())[:, 0].tolist())
    assert set(got[:, 2].tolist()) <= allowed_min_p


def test_greedy_rows_mixed_with_sampled_rows():
    logits = torch.randn(2, VOCAB)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    got = draw(logits, params, 50)
    assert (got[:, 0] == logits[0].argmax()).all()


def test_seeded_rows_reproduce_and_differ_by_seed():
    logits = torch.zeros(2, VOCAB)  # uniform: every token equally likely
    params = [SamplingParams(seed=7), SamplingParams(seed=8)]
    a = [sample(logits, params, [i, i]).token_ids.tolist() for i in range(20)]
    b = [sample(logits, params, [i, i]).token_ids.tolist() for i in range(20)]
    assert a == b
    assert [x[0] for x in a] != [x[1] for x in a]
    assert len({x[0] for x in a}) > 5  # the step offset changes the draw


def test_seeded_generation_reproduces(make_engine):
    engine = make_engine(prefix_cache="none")
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    a = engine.generate(["Once upon a time"], p)[0].token_ids
    # Different batch company must not change a seeded request's tokens.
    b = engine.generate(["Once upon a time", "Other prompt"], [p, SamplingParams()])[0]
    assert a == b.token_ids
    c = engine.generate(
        ["Once upon a time"],
        SamplingParams(max_tokens=16, temperature=1.0, seed=124, ignore_eos=True),
    )[0].token_ids
    assert a != c


def test_penalties():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0)
    x = logits.clone()
    apply_penalties(x, [p], [[0]], [[2]])
    assert x.tolist() == [[1.0, 1.0, -2.0, 0.5]]
    p = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)
    x = logits.clone()
    apply_penalties(x, [p], [[0]], [[1, 1, 3]])
    assert x.tolist() == [[2.0, -1.0, -1.0, -1.0]]


def test_presence_penalty_prevents_repeats(make_engine):
    engine = make_engine(prefix_cache="none")
    out = engine.generate(
        ["The the the the"],
        SamplingParams(
            max_tokens=24,
            temperature=0,
            presence_penalty=2.0,
            frequency_penalty=2.0,
            ignore_eos=True,
        ),
    )[0]
    plain = engine.generate(
        ["The the the the"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )[0]
    assert len(set(out.token_ids)) > len(set(plain.token_ids)) or len(set(out.token_ids)) == 24


def test_output_logprobs_are_log_softmax(make_engine):
    engine = make_engine(prefix_cache="none")
    out = engine.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, logprobs=True))
    lps = out[0].logprobs
    assert len(lps) == len(out[0].token_ids) and all(lp <= 0 for lp in lps)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprob_start_len": 0}, "logprob_start_len"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(RequestValueError, match=f"invalid {field}=") as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_cpu_argmax_equals_torch_argmax():
    """The numpy argmax the CPU sampler uses picks what torch.argmax picks: the first
    maximum on ties, a NaN over any number, row 0 of an all -inf row; strided input too."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 300, generator=gen)
    logits[1, [5, 17]] = 50.0  # a tie
    logits[2, [40, 7]] = float("nan")
    logits[3] = float("-inf")
    logits[4, 100:] = float("inf")
    for x in (logits, logits[::2], logits[:, 1:], logits.t().contiguous().t()):
        got = _argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_frequencies_follow_the_distribution(seeded):
    """Many draws per row: each token's frequency is its probability under `sampling_probs`
    (temperature, top-k, top-p, min-p), within 4.5 standard errors; filtered-out tokens never
    appear (seeded rows: a new seed offset every draw)."""
    from radixrt.executor.sampler import sampling_probs

    torch.manual_seed(1)
    logits = torch.randn(5, 12) * 1.5
    seed = 5 if seeded else None
    params = [
        SamplingParams(temperature=0.8, top_k=7, seed=seed),
        SamplingParams(temperature=1.3, seed=seed),
        SamplingParams(temperature=1.0, top_p=0.7, seed=seed),
        SamplingParams(temperature=1.0, min_p=0.1, seed=seed),
        SamplingParams(temperature=0.9, top_k=9, top_p=0.9, min_p=0.05, seed=seed),
    ]
    n = 6000
    got = torch.stack([sample(logits, params, [i] * 5).token_ids for i in range(n)])
    want = sampling_probs(logits, params).double()
    for row in range(len(params)):
        freq = torch.bincount(got[:, row], minlength=12).double() / n
        se = (want[row] * (1 - want[row]) / n).sqrt()
        assert ((freq - want[row]).abs() <= 4.5 * se + 1e-9).all(), (row, freq, want[row])
        assert (freq[want[row] == 0] == 0).all()
