"""n > 1 and beam search on the tiny model (CPU, float32): forks equal independent requests,
the prompt is computed once, beam search equals HF transformers' token for token."""

from __future__ import annotations

import pytest
import torch
import transformers

from radixrt import BeamSearchParams, SamplingParams
from radixrt.deltas import FinishReason

PROMPTS = [
    "The quick brown fox jumps",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "A",
]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cache", ["none", "radix", "blockhash"])
def test_greedy_children_equal_n1_and_prompt_is_computed_once(make_engine, cache, overlap):
    engine = make_engine(prefix_cache=cache, block_size=4, overlap_schedule=overlap)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ones = engine.generate(prompt_token_ids=ids, sampling_params=greedy)
    engine.cache.reset()
    before = engine.stats()["prompt_tokens_computed"]
    n = 4
    outs = engine.generate(
        prompt_token_ids=ids,
        sampling_params=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=n),
    )
    assert len(outs) == n * len(ids)
    for i, one in enumerate(ones):
        group = outs[n * i : n * (i + 1)]
        assert [o.index for o in group] == list(range(n))
        assert all(o.token_ids == one.token_ids and o.text == one.text for o in group)
        assert all(o.finish_reason is FinishReason.LENGTH for o in group)
        assert all(o.prompt_tokens == len(ids[i]) for o in group)
    # each prompt but its last token once, then the last token once per child
    computed = engine.stats()["prompt_tokens_computed"] - before
    assert computed == sum(len(p) - 1 + n for p in ids)


def test_seeded_children_reproduce_and_equal_seeded_n1(make_engine):
    engine = make_engine(prefix_cache="radix")
    ids = engine.tokenizer.encode(PROMPTS[1])
    for seed in (7, 2**63 - 2):
        params = SamplingParams(max_tokens=12, seed=seed, n=3, temperature=0.9, top_p=0.95)
        a = [o.token_ids for o in engine.generate(prompt_token_ids=[ids], sampling_params=params)]
        b = [o.token_ids for o in engine.generate(prompt_token_ids=[ids], sampling_params=params)]
        assert a == b and len(set(map(tuple, a))) > 1
        for i in range(3):
            single = SamplingParams(
                max_tokens=12, seed=(seed + i) % 2**63, temperature=0.9, top_p=0.95
            )
            one = engine.generate(prompt_token_ids=[ids], sampling_params=single)[0]
            assert one.token_ids == a[i]


def test_abort_mid_fan_out_and_stream(make_engine):
    engine = make_engine(prefix_cache="none", overlap_schedule=True)
    ids = engine.tokenizer.encode(PROMPTS[0])
    rid = engine.add_request(ids, SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort(rid)
    finished = {}
    while engine.core.has_work:
        for d, _ in engine.step():
            if d.finished:
                finished[d.rid] = d.finish_reason
    assert len(finished) == 3 and set(finished.values()) == {FinishReason.ABORT}
    engine.check_integrity()
    # the group's id, then a child's (already finished with it): nothing left, nothing fails
    rid = engine.add_request(ids, SamplingParams(max_tokens=50, n=2))
    engine.step()
    engine.abort(rid)
    engine.abort(rid + "#0")
    while engine.core.has_work:
        engine.step()
    engine.check_integrity()
    # a consumer that stops early aborts every child
    stream = engine.generate_stream(
        prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=50, n=3)
    )
    deltas = [next(stream) for _ in range(4)]
    assert {d.choice for d in deltas} <= {0, 1, 2}
    stream.close()


# ---- beam search vs HF ----
def hf_beams(model, ids, width, max_new, length_penalty, eos):
    x = torch.tensor([ids])
    with torch.no_grad():
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_new,
            length_penalty=length_penalty,
            early_stopping=False,
            eos_token_id=eos,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    seqs = []
    for s in y.sequences[:, len(ids) :].tolist():
        if eos:  # cut the padding after the first EOS
            for j, t in enumerate(s):
                if t in eos:
                    s = s[: j + 1]
                    break
        seqs.append(s)
    return seqs, y.sequences_scores.tolist()


def model_logprob(model, ids, out) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(ids) - 1 : -1]
    return lp.gather(1, torch.tensor(out).unsqueeze(1)).sum().item()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("eos_in_play", [False, True])
def test_beam_search_equals_hf(make_engine, hf_model, width, eos_in_play):
    engine = make_engine(prefix_cache="radix", block_size=4)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    max_new = 8
    eos = None
    if eos_in_play:
        # A token HF's beams pick mid-way becomes the EOS: beams finish at different lengths.
        seqs, _ = hf_beams(hf_model, ids[0], width, max_new, 1.0, None)
        eos = [seqs[0][2]]
        engine.scheduler.eos_token_ids = frozenset(eos)
    ended = 0
    # up to the top of length_penalty's range and below 0; not -10, where scores pass -1e9,
    # the placeholder score HF's search gives unfinished hypotheses (HF returns it then)
    for lp in (1.0, 0.5, 10.0, -1.0):
        params = BeamSearchParams(
            beam_width=width, max_tokens=max_new, length_penalty=lp, ignore_eos=not eos_in_play
        )
        outs = engine.beam_search(prompt_token_ids=ids, params=params)
        engine.check_integrity()
        for p, out in zip(ids, outs):
            ref, ref_scores = hf_beams(hf_model, p, width, max_new, lp, eos)
            assert [s.token_ids for s in out.sequences] == ref
            got = [s.score for s in out.sequences]
            assert got == pytest.approx(ref_scores, abs=1e-4)
            assert got == sorted(got, reverse=True) and out.prompt_tokens == len(p)
            for s in out.sequences:
                assert s.cumulative_logprob == pytest.approx(
                    model_logprob(hf_model, p, s.token_ids), abs=1e-4
                )
                assert s.score == pytest.approx(s.cumulative_logprob / len(s.token_ids) ** lp)
                assert s.text == engine.tokenizer.decode(s.token_ids, skip_special_tokens=True)
            if eos_in_play:  # EOS only ever ends a sequence
                assert all(t not in eos for s in out.sequences for t in s.token_ids[:-1])
                ended += sum(s.token_ids[-1] in eos for s in out.sequences)
    assert ended > 0 if eos_in_play else ended == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_beam_search_under_preemption_with_other_requests(make_engine, hf_model, overlap):
    engine = make_engine(
        prefix_cache="none", block_size=4, num_kv_blocks=24, overlap_schedule=overlap
    )
    ids = engine.tokenizer.encode(PROMPTS[1])
    other = [engine.tokenizer.encode(p) for p in PROMPTS]
    for p in other:
        engine.add_request(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    out = engine.beam_search(prompt_token_ids=[ids], params=params)[0]
    ref, _ = hf_beams(hf_model, ids, 3, 10, 1.0, None)
    assert [s.token_ids for s in out.sequences] == ref
    while engine.core.has_work:
        engine.step()
    assert engine.stats()["preemptions"] > 0


def test_beam_search_bad_input(make_engine):
    engine = make_engine(num_kv_blocks=64, block_size=16)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0)
    with pytest.raises(ValueError, match="beam_width"):
        # the tiny model has 2 EOS ids: 3 * 7 candidates > 20 top log-probs per row
        engine.beam_search("hi", BeamSearchParams(beam_width=7))
    with pytest.raises(ValueError, match="beam_width"):
        engine.beam_search("hi", BeamSearchParams(beam_width=6, max_tokens=500))
    assert not engine.scheduler.requests


def test_beam_abort_mid_search(make_engine):
    engine = make_engine(overlap_schedule=True)
    rid = engine.core.add_beam_search(
        engine.tokenizer.encode(PROMPTS[0]),
        BeamSearchParams(beam_width=4, max_tokens=30, ignore_eos=True),
    )
    for _ in range(5):
        engine.step()
    d = engine.core.abort(rid)
    assert d.finish_reason is FinishReason.ABORT and d.beams == []
