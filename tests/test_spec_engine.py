"""Speculative decoding in the engine (CPU, tiny model): greedy and seeded-sampling outputs are
identical with speculation off, `ngram` and `radix`, under chunked prefill, preemption, overlap
and with the cache off; drafts that are always wrong change nothing; a re-run program is
drafted from the radix tree and accepted in full. The make_engine fixture checks integrity and
that no KV leaked after every test."""

from __future__ import annotations

import pytest

from radixrt import SamplingParams
from radixrt.speculative.base import Proposer

TEXTS = [
    "the cat sat on the mat. the cat sat on the mat. the cat sat on",
    "Once upon a time there was a dragon. Once upon a time",
    "1 2 3 4 1 2 3 4 1 2 3",
    "Tell me a story about the sea",
]
MAX_TOKENS = [20, 16, 24, 12]


def greedy() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]


def seeded() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=m, temperature=0.8, top_p=0.95, seed=7 + i, ignore_eos=True)
        for i, m in enumerate(MAX_TOKENS)
    ]


def outputs(engine, params) -> list[list[int]]:
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    engine.check_integrity()
    return [o.token_ids for o in outs]


def last_deltas(engine, prompts, params) -> tuple[list[str], dict]:
    """Add the requests, step until done; (their ids, each request's last delta)."""
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    last = {}
    while engine.core.has_work:
        for delta, _ in engine.step():
            last[delta.rid] = delta
    engine.check_integrity()
    return rids, last


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from radixrt import Engine

    engine = Engine(tiny_model_dir, device="cpu", dtype="float32", block_size=4)
    return {"greedy": outputs(engine, greedy()), "seeded": outputs(engine, seeded())}


CONFIGS = [
    dict(),
    dict(long_prefill_token_threshold=5),  # chunked prefill
    dict(num_kv_blocks=14),  # preemption
    dict(overlap_schedule=True),
    dict(prefix_cache="none"),
]


# the radix proposer needs the radix cache (without it: a ValueError, tested in test_spec)
CASES = [
    (method, config)
    for method in ("ngram", "radix")
    for config in CONFIGS
    if not (method == "radix" and config.get("prefix_cache") == "none")
]


@pytest.mark.parametrize(("method", "config"), CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_outputs_identical_with_speculation(make_engine, reference, method, config):
    # speculative_min_gain 0: every drafted row verifies, overlap or not (by default a step
    # with overlap verifies only when its rows expect enough accepted drafts: 4 short rows
    # rarely do, and this test is about verify rows)
    engine = make_engine(
        block_size=4,
        speculative_method=method,
        num_speculative_tokens=3,
        ngram_min_n=1,
        speculative_min_gain=0.0,
        **config,
    )
    for kind, params in (("greedy", greedy()), ("seeded", seeded())):
        assert outputs(engine, params) == reference[kind], kind
        assert outputs(engine, params) == reference[kind], f"{kind}, run again"
    s = engine.stats()
    assert s["spec_proposals"] > 0
    if config.get("num_kv_blocks"):
        assert s["preemptions"] > 0
    if method == "ngram":
        assert s["spec_accepted_tokens"] > 0  # the texts repeat themselves
    elif not config.get("num_kv_blocks"):  # second runs find their answers in the tree
        assert s["spec_proposals_with_drafts"] > 0
        assert s["spec_acceptance_rate"] > 0.9


def test_radix_rerun_accepts_everything(make_engine, reference):
    """A re-run (same prompts, same seeds) is drafted from the tree: every draft is accepted,
    far fewer steps than the first run, per-request counters in the deltas."""
    engine = make_engine(block_size=4, speculative_method="radix", num_speculative_tokens=4)
    for kind, params in (("greedy", greedy()), ("seeded", seeded())):
        assert outputs(engine, params) == reference[kind]
        first = engine.stats()
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        rids, last = last_deltas(engine, prompts, params)
        s = engine.stats()
        drafted = s["spec_draft_tokens"] - first["spec_draft_tokens"]
        accepted = s["spec_accepted_tokens"] - first["spec_accepted_tokens"]
        assert drafted > 0 and accepted == drafted, kind
        assert sum(last[r].num_draft_tokens for r in rids) == drafted
        assert sum(last[r].num_accepted_tokens for r in rids) == accepted
        assert s["steps"] - first["steps"] < first["steps"] / 2


def test_always_wrong_drafts_change_nothing(make_engine, reference):
    """A proposer whose drafts are always rejected: same outputs, nothing accepted, blocks
    rolled back (integrity checked after each run and at teardown)."""

    class Wrong(Proposer):
        def propose(self, tokens, max_drafts, salt=None):
            last = tokens[-1]
            return [(last + 1 + i) % 50 + 100 for i in range(max_drafts)]

    engine = make_engine(block_size=4, num_kv_blocks=24)
    engine.scheduler.use_proposer(Wrong())
    assert outputs(engine, greedy()) == reference["greedy"]
    s = engine.stats()
    assert s["spec_draft_tokens"] > 0
    assert s["spec_accepted_tokens"] <= s["spec_draft_tokens"] // 20  # (a rare lucky draft)


def test_radix_method_needs_the_radix_cache(make_engine):
    with pytest.raises(ValueError, match="radix prefix cache"):
        make_engine(prefix_cache="blockhash", speculative_method="radix")


def test_beam_search_and_n_with_speculation(make_engine):
    """Beams never draft and n > 1 children may: results equal speculation off."""
    from radixrt.sampling import BeamSearchParams

    prompt = "Once upon a time"
    outs = {}
    for method in ("none", "ngram"):
        engine = make_engine(prefix_cache="radix", speculative_method=method)
        beams = engine.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=6))
        many = engine.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=0))
        outs[method] = (
            [s.token_ids for b in beams for s in b.sequences],
            [o.token_ids for o in many],
        )
        engine.check_integrity()
    assert outs["ngram"] == outs["none"]


@pytest.mark.parametrize("method", ["ngram", "radix"])
def test_verify_rows_as_decode_rows_same_outputs(make_engine, reference, method):
    """Verify rows fed as one decode row per token (what the decode CUDA graphs replay),
    run eagerly on CPU from the graphs' own host metadata: outputs identical to no
    speculation, greedy and seeded, and verify steps did take that path."""
    from eager_decode_graphs import EagerDecodeGraphs

    engine = make_engine(
        block_size=4, speculative_method=method, num_speculative_tokens=3, ngram_min_n=1
    )
    graphs = engine.core.runner.cuda_graphs = EagerDecodeGraphs(engine.core.runner)
    assert outputs(engine, greedy()) == reference["greedy"]
    assert outputs(engine, greedy()) == reference["greedy"]  # radix: drafted from the tree
    assert outputs(engine, seeded()) == reference["seeded"]
    assert any(tokens > rows for rows, tokens, _ in graphs.calls)  # verify rows went through
    assert engine.stats()["spec_accepted_tokens"] > 0
