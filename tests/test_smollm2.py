"""radixrt on a real model, SmolLM2-135M-Instruct (its pinned GGUF file), CPU float32,
against HF transformers' own loading of the same file (tests/data/smollm2_reference.json,
written by tests/data/make_smollm2_reference.py): the chat template's token ids, 64 greedy
tokens on each chat, prompt and top-5 log-probs; and streamed text equal to the text decoded
at once. One engine run (batched) serves every test."""

from __future__ import annotations

import json
import os

import pytest
from smollm2_model import smollm2_gguf  # noqa: F401  (fixture)
from smollm2_prompts import CHATS, LOGPROB_PROMPTS, NEW_TOKENS, TOP_LOGPROBS

from radixrt import Engine, SamplingParams
from radixrt.hf_dir.smollm2 import GGUF_SHA256

REFERENCE = os.path.join(os.path.dirname(__file__), "data", "smollm2_reference.json")
TIE_MARGIN = 1e-4  # HF's top-2 logit gap below which a different greedy token is a tie
LOGPROB_ATOL = 1e-3
LONG = [i for i, chat in enumerate(CHATS) if len(chat[0]["content"]) > 1000]
# of those, the ones that share the first's prefix (a developer message renders differently)
LONG_SHARED = [i for i in LONG if CHATS[i][0]["role"] == CHATS[LONG[0]][0]["role"]]


@pytest.fixture(scope="module")
def reference() -> dict:
    with open(REFERENCE) as f:
        ref = json.load(f)
    assert ref["gguf_sha256"] == GGUF_SHA256 and ref["new_tokens"] == NEW_TOKENS
    assert [c["messages"] for c in ref["chats"]] == CHATS, "rerun make_smollm2_reference.py"
    return ref


@pytest.fixture(scope="module")
def run(smollm2_gguf):  # noqa: F811
    """Every chat through one engine: {"prompt_ids", "outputs", "tok"}. The long chats after
    the first run in a second batch: a cache hit."""
    engine = Engine(smollm2_gguf, device="cpu", dtype="float32", num_kv_blocks=1024)
    try:
        tok = engine.tokenizer
        prompt_ids = [
            tok.encode(
                tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )
            for chat in CHATS
        ]
        params = [
            SamplingParams(
                max_tokens=NEW_TOKENS,
                temperature=0,
                ignore_eos=True,
                prompt_logprobs=i < LOGPROB_PROMPTS,
                logprobs=i < LOGPROB_PROMPTS,
                top_logprobs=TOP_LOGPROBS if i < LOGPROB_PROMPTS else 0,
            )
            for i in range(len(CHATS))
        ]
        later = LONG[1:]
        first = [i for i in range(len(CHATS)) if i not in later]
        outputs = {}
        for batch in (first, later):
            outs = engine.generate(
                prompt_token_ids=[prompt_ids[i] for i in batch],
                sampling_params=[params[i] for i in batch],
            )
            outputs.update(zip(batch, outs))
        engine.check_integrity()
        yield {"prompt_ids": prompt_ids, "outputs": outputs, "tok": tok}
    finally:
        engine.shutdown()


def test_chat_template_gives_hf_token_ids(run, reference):
    for i, chat in enumerate(reference["chats"]):
        assert run["prompt_ids"][i] == chat["prompt_ids"], f"chat {i}"


def test_greedy_tokens_match_hf(run, reference):
    assert len(CHATS) >= 40
    diverged = []
    for i, chat in enumerate(reference["chats"]):
        ours, theirs = run["outputs"][i].token_ids, chat["output_ids"]
        assert len(ours) == NEW_TOKENS
        if ours == theirs:
            continue
        pos = next(p for p, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        margin = chat["margins"][pos]
        print(f"chat {i}: first differing position {pos}, HF's top-2 margin {margin:.2e}")
        diverged.append((i, pos, margin))
    assert all(m < TIE_MARGIN for _, _, m in diverged), diverged


def test_long_prompts_hit_the_cache(run):
    assert len(LONG_SHARED) >= 3
    for i in LONG_SHARED[1:]:
        out = run["outputs"][i]
        assert out.num_cached_tokens > 0.8 * out.prompt_tokens, (i, out.num_cached_tokens)


def test_logprobs_match_hf(run, reference):
    for i in range(LOGPROB_PROMPTS):
        out, ref = run["outputs"][i], reference["chats"][i]
        assert len(out.prompt_logprobs) == len(ref["prompt_logprobs"])
        for a, b in zip(out.prompt_logprobs, ref["prompt_logprobs"]):
            assert abs(a - b) < LOGPROB_ATOL, (i, a, b)
        for step, (ours, theirs) in enumerate(zip(out.top_logprobs, ref["top_logprobs"])):
            if out.token_ids[: step + 1] != ref["output_ids"][: step + 1]:
                break  # a tie went the other way: the contexts differ from here on
            assert [t for t, _ in ours] == [t for t, _ in theirs] or _near_tie(ours), (i, step)
            for (_, a), (_, b) in zip(ours, theirs):
                assert abs(a - b) < LOGPROB_ATOL, (i, step, a, b)


def _near_tie(top: list[tuple[int, float]]) -> bool:
    return any(abs(a[1] - b[1]) < LOGPROB_ATOL for a, b in zip(top, top[1:]))


def test_streamed_text_equals_the_text_decoded_at_once(run):
    # Engine.generate's text is its stream's deltas joined (byte-fallback and multi-byte
    # characters split across tokens included); the server's SSE is test_smollm2_server's
    tok = run["tok"]
    for i in range(len(CHATS)):
        out = run["outputs"][i]
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True), i
