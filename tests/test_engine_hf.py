"""Greedy tokens and log-probs equal HF transformers' on the same checkpoint (float32, CPU),
for both tiny checkpoints: trained and random weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from radixrt import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "Numbers: 1, 2, 3,",
    "A",
    "The weather today is sunny and warm, so we decided to walk to the park and",
    "Question: what is the capital of France? Answer:",
    "In the beginning the universe was created. This has made a lot of people very "
    "angry and been widely regarded as a bad move. Then",
]


@pytest.fixture(params=["trained", "random"])
def model_dir(request) -> str:
    name = "tiny_model_dir" if request.param == "trained" else "tiny_random_model_dir"
    return request.getfixturevalue(name)


def hf_greedy(model_dir: str, prompt_ids: list[list[int]], max_new: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # as ignore_eos (min_new_tokens masks EOS out)
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_matches_hf(make_engine, model_dir, overlap):
    engine = make_engine(model_dir, prefix_cache="none", overlap_schedule=overlap)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ours = engine.generate(prompt_token_ids=ids, sampling_params=params)
    ref = hf_greedy(model_dir, ids, 32)
    for o, r in zip(ours, ref):
        assert o.token_ids == r
        assert o.completion_tokens == 32 and o.finish_reason == "length"
        assert o.prompt_tokens == len(ids[ours.index(o)])


def hf_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from HF."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def test_prompt_logprobs_match_hf_with_cached_prefix(make_engine, model_dir):
    engine = make_engine(model_dir, prefix_cache="radix", block_size=4, max_num_batched_tokens=8)
    prefix = engine.tokenizer.encode(PROMPTS[7])
    full = prefix + engine.tokenizer.encode(" and then everyone laughed")
    ref = hf_logprobs(model_dir, full)
    # Warm the cache with the prefix, then ask for log-probs of the suffix only.
    engine.generate(prompt_token_ids=[prefix], sampling_params=SamplingParams(max_tokens=1))
    start = len(prefix)
    params = SamplingParams(max_tokens=0, prompt_logprobs=True, logprob_start_len=start)
    out = engine.generate(prompt_token_ids=[full], sampling_params=params)[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.num_cached_tokens == start - 1  # the prefix, less the recomputed token
    torch.testing.assert_close(
        torch.tensor(out.prompt_logprobs), ref[start - 1 :], atol=1e-4, rtol=1e-4
    )
    # Whole prompt, chunked across steps.
    params = SamplingParams(max_tokens=2, prompt_logprobs=True, temperature=0)
    out = engine.generate(prompt_token_ids=[full], sampling_params=params)[0]
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), ref, atol=1e-4, rtol=1e-4)
    assert len(out.token_ids) == 2
