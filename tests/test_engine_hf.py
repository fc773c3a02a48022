"""Greedy tokens equal HF transformers' on the same checkpoint (float32, CPU)."""

from __future__ import annotations

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


def hf_greedy(model_dir: str, prompt_ids: list[list[int]], max_new: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                min_new_tokens=max_new,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def test_greedy_matches_hf(make_engine, tiny_model_dir):
    engine = make_engine(prefix_cache="none")
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ours = engine.generate(prompt_token_ids=ids, sampling_params=params)
    ref = hf_greedy(tiny_model_dir, ids, 32)
    for o, r in zip(ours, ref):
        assert o.token_ids == r
        assert o.completion_tokens == 32 and o.finish_reason == "length"
        assert o.prompt_tokens == len(ids[ours.index(o)])
