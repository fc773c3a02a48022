"""The real ModelRunner (CPU, tiny checkpoint) executing hand-made plans: forks over shared
blocks with a copy op, draft verification, rejected ops; and the scheduler's in-place append
checked at the KV-content level."""

from __future__ import annotations

import pytest
import torch

from radixrt import SamplingParams
from radixrt.plan import CopyBlock, PlanRow, SlotEntry, StepPlan, SwapIn

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(make_engine):
    return make_engine(prefix_cache="none", block_size=4, num_kv_blocks=64)


def row(slot, start, ids, blocks, samples, **kw) -> PlanRow:
    return PlanRow(
        rid=f"s{slot}",
        slot=slot,
        start=start,
        num_tokens=len(ids),
        input_ids=list(ids),
        new_blocks=list(blocks),
        sample_offsets=list(samples),
        **kw,
    )


def entered(runner, step_id, rows, ops=(), drafts=None) -> StepPlan:
    """A plan whose rows' slots are (re)entered with GREEDY first."""
    entries = [SlotEntry(r.slot, runner.slots.incarnations[r.slot] + 1, GREEDY) for r in rows]
    return StepPlan(step_id, rows, list(ops), new_slots=entries, drafts=drafts or {})


def test_fork_over_shared_blocks_with_copy_op(engine):
    """A row whose block table references another row's full blocks, plus a copy of the
    partial last block (a CopyBlock op), attends exactly like a row computed from scratch."""
    runner = engine.core.runner
    prompt = engine.tokenizer.encode("Tell me a story about a dragon")[:10]
    assert len(prompt) == 10
    runner.execute(entered(runner, 0, [row(0, 0, prompt, [40, 41, 42], [9])])).result()
    fork = row(1, 10, [77], [40, 41, 50], [0])
    forked = runner.logits(entered(runner, 1, [fork], [CopyBlock(42, 50, 2)]))
    scratch = runner.logits(entered(runner, 2, [row(2, 0, prompt + [77], [51, 52, 53], [10])]))
    torch.testing.assert_close(forked, scratch, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="host KV tier"):
        plan = entered(runner, 3, [row(3, 0, prompt, [54, 55, 56], [9])], [SwapIn(0, 54)])
        runner.execute(plan)


def test_runner_verifies_drafts(engine):
    """Rows of k + 1 tokens with samples at every position: the runner accepts the longest
    prefix of drafts equal to its samples and adds the next sample (1..k + 1 tokens)."""
    runner = engine.core.runner
    prompt = engine.tokenizer.encode("Once upon a time there was")
    greedy = engine.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
    n = len(prompt)
    blocks = list(range(20, 20 + (n + 8) // 4 + 1))
    cases = [(greedy[:4], greedy[:5]), (greedy[:2] + [5, 5], greedy[:3]), ([5] * 4, greedy[:1])]
    for slot, (drafts, want) in enumerate(cases):
        r = row(slot, 0, prompt, blocks, range(n - 1, n + 4), num_draft_tokens=4)
        r.num_tokens += 4
        got = runner.execute(entered(runner, slot, [r], drafts={0: drafts})).result().tokens[0]
        assert got == want, (drafts, got, want)


def test_inplace_append_kv_content(make_engine):
    """A match that ends inside a block only the cache node holds is written on in place:
    the KV of every position equals that of a fresh engine computing the same tokens."""
    opts = dict(prefix_cache="radix", block_size=8, num_kv_blocks=64)
    first = make_engine(**opts)
    # 8 prompt tokens (one block, cached when the prefill lands) + 3 generated tokens with
    # KV (cached at the finish, as a node starting at a block boundary): block 1 then holds
    # 3 cached tokens that only one node records
    prompt = first.tokenizer.encode("The weather today is sunny and warm so we")[:8]
    a = first.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
    )[0]
    before = first.stats()["inplace_appends"]
    b_prompt = prompt + a.token_ids + [11, 12, 13, 14, 15]
    b = first.generate(prompt_token_ids=[b_prompt], sampling_params=GREEDY)[0]
    assert first.stats()["inplace_appends"] == before + 1  # 11 cached: 8 + 3 in place
    fresh = make_engine(**opts)
    b_ref = fresh.generate(prompt_token_ids=[b_prompt], sampling_params=GREEDY)[0]
    assert b.token_ids == b_ref.token_ids
    seq = b_prompt + b.token_ids[:-1]  # tokens whose KV was computed

    def kv_of(engine) -> torch.Tensor:
        m = engine.cache.match(seq)
        assert m.num_cached_tokens == len(seq)
        pos = torch.arange(len(seq))
        blocks = torch.tensor(m.blocks)[pos // 8]
        return engine.core.runner.pool.kv[:, :, blocks, pos % 8]

    torch.testing.assert_close(kv_of(first), kv_of(fresh), rtol=1e-5, atol=1e-5)


def test_logit_bias_and_top_logprobs(make_engine):
    """logit_bias moves the logits before sampling (greedy included); top_logprobs returns
    the k most likely tokens per output token, the sampled greedy token first."""
    engine = make_engine(prefix_cache="radix", overlap_schedule=True)
    ids = engine.tokenizer.encode("Once upon a time there was")
    plain = engine.generate(prompt_token_ids=[ids], sampling_params=GREEDY)[0].token_ids
    forced = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={42: 100.0})
    assert engine.generate(prompt_token_ids=[ids], sampling_params=forced)[0].token_ids == [42] * 6
    banned = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logit_bias={plain[0]: -100.0}
    )
    assert (
        engine.generate(prompt_token_ids=[ids], sampling_params=banned)[0].token_ids[0] != plain[0]
    )
    top = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    out = engine.generate(prompt_token_ids=[ids], sampling_params=top)[0]
    assert out.token_ids == plain and len(out.top_logprobs) == 6
    for token, lp, alts in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(alts) == 3 and alts[0][0] == token and abs(alts[0][1] - lp) < 1e-5
        assert alts[0][1] >= alts[1][1] >= alts[2][1]
    with pytest.raises(ValueError, match="logit_bias token id"):
        engine.add_request(ids, SamplingParams(logit_bias={10**6: 1.0}))
