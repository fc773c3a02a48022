"""Chunked prefill, preemption and batching do not change greedy outputs."""

from __future__ import annotations

import pytest

from radixrt import SamplingParams

PROMPTS = [
    "Tell me a story about a dragon who",
    "The list of ingredients: flour, sugar,",
    "x",
    "Why is the sky blue? Because",
    "One two three four five six seven eight nine ten eleven twelve thirteen",
    "import numpy as np\nimport torch\n\ndef main():\n",
    "Dear diary, today I",
    "The meeting was moved to",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def run(engine, prompts=PROMPTS, params=GREEDY):
    outs = engine.generate(prompts, params)
    engine.check_integrity()
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from radixrt import Engine

    engine = Engine(tiny_model_dir, device="cpu", dtype="float32", prefix_cache="none")
    return run(engine)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cache", ["none", "radix", "blockhash"])
def test_chunked_prefill_same_tokens(make_engine, reference, cache, overlap):
    engine = make_engine(prefix_cache=cache, max_num_batched_tokens=7, overlap_schedule=overlap)
    assert run(engine) == reference
    assert engine.scheduler.stats.steps > len(PROMPTS)


@pytest.mark.parametrize("cache", ["none", "radix"])
def test_long_prefill_threshold_same_tokens(make_engine, reference, cache):
    engine = make_engine(prefix_cache=cache, long_prefill_token_threshold=3)
    assert run(engine) == reference


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cache", ["none", "radix", "blockhash"])
def test_preemption_same_tokens(make_engine, reference, cache, overlap):
    # 12 blocks of 4 tokens: far less than 8 prompts x (prompt + 24) tokens need.
    engine = make_engine(
        prefix_cache=cache, block_size=4, num_kv_blocks=12, overlap_schedule=overlap
    )
    assert run(engine) == reference
    assert engine.scheduler.stats.preemptions > 0


def test_max_running_and_block_sizes(make_engine, reference):
    for bs in (1, 8):
        engine = make_engine(prefix_cache="none", block_size=bs, max_running_requests=3)
        assert run(engine) == reference


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_conditions(make_engine, overlap):
    engine = make_engine(prefix_cache="none", overlap_schedule=overlap)
    free = engine.generate(PROMPTS[:2], GREEDY)
    # stop_token_ids: stop at the 5th generated token of the first prompt
    stop_tok = free[0].token_ids[4]
    out = engine.generate(
        PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_tok])
    )[0]
    first = free[0].token_ids.index(stop_tok)
    assert out.token_ids == free[0].token_ids[: first + 1] and out.finish_reason == "stop"
    # stop string: text is cut before it
    text = free[1].text
    stop = text[5:8]
    out = engine.generate(
        PROMPTS[1:2], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    # max_tokens
    out = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.token_ids) <= 3
    # context length: an explicit max_tokens must fit; None means all the room left
    small = make_engine(prefix_cache="none", max_model_len=20)
    ids = small.tokenizer.encode(PROMPTS[0])
    with pytest.raises(ValueError, match=f"max_tokens=24 does not fit.*{len(ids)} in the prompt"):
        small.generate(prompt_token_ids=[ids], sampling_params=GREEDY)
    room = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    out = small.generate(prompt_token_ids=[ids], sampling_params=room)[0]
    assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == 20


def test_eos_stops_unless_ignored(make_engine):
    engine = make_engine(prefix_cache="none")
    assert engine.tokenizer.eos_token_id in engine.scheduler.eos_token_ids
    free = engine.generate(PROMPTS[:1], GREEDY)[0].token_ids
    # Treat the 4th generated token as EOS: generation must stop right there.
    engine.scheduler.eos_token_ids = frozenset({free[3]})
    out = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0))[0]
    assert out.token_ids == free[: free.index(free[3]) + 1] and out.finish_reason == "stop"
    out = engine.generate(PROMPTS[:1], GREEDY)[0]
    assert out.token_ids == free and out.finish_reason == "length"


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_frees_kv(make_engine, overlap):
    engine = make_engine(prefix_cache="radix", overlap_schedule=overlap)
    rids = [engine.add_request(engine.tokenizer.encode(p), GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    for rid in rids[::2]:
        engine.abort(rid)
    engine.check_integrity()
    while engine.core.has_work:
        engine.step()
    engine.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_streaming_matches_generate(make_engine, reference, overlap):
    engine = make_engine(prefix_cache="none", overlap_schedule=overlap)
    tokens = [[] for _ in PROMPTS]
    finished = set()
    for d in engine.generate_stream(PROMPTS, GREEDY):
        tokens[d.index] += d.token_ids
        if d.finish_reason:
            finished.add(d.index)
    assert tokens == reference and finished == set(range(len(PROMPTS)))


def test_stream_consumer_stopping_early_frees_kv(make_engine):
    engine = make_engine(prefix_cache="radix")
    stream = engine.generate_stream(PROMPTS, GREEDY)
    next(stream)
    stream.close()
    engine.check_integrity()
    assert not engine.scheduler.has_work


def test_bad_input_raises_value_error(make_engine):
    engine = make_engine(prefix_cache="none", max_model_len=64, num_kv_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate(prompt_token_ids=[[1, 10**9]])
    with pytest.raises(ValueError, match="empty"):
        engine.generate(prompt_token_ids=[[]])
    with pytest.raises(ValueError, match="context length"):
        engine.generate(prompt_token_ids=[[5] * 64])
    with pytest.raises(ValueError, match="KV blocks"):
        engine.generate(prompt_token_ids=[[5] * 40], sampling_params=SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="unknown engine option"):
        make_engine(not_an_option=1)
    with pytest.raises(ValueError, match="retention_max_share"):
        make_engine(retention_max_share=1.5)
    engine.check_integrity()
