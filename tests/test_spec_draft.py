"""Draft-model speculation in the engine (CPU, tiny model): greedy outputs identical with
speculation off for a perfect draft (the target itself: every draft accepted), a useless one
(random weights) and under chunked prefill, preemption, overlap and no cache; a cached prefix
has draft KV (a re-run with the target as draft still accepts everything); seeded sampling
is reproducible; per-request counters; bad draft checkpoints fail at startup. Rejection
sampling's distribution is tested in test_spec_rejection. The make_engine fixture checks
integrity and that no KV leaked after every test."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from test_spec_engine import TEXTS, greedy, last_deltas, outputs, seeded

from radixrt import SamplingParams


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from radixrt import Engine

    engine = Engine(tiny_model_dir, device="cpu", dtype="float32", block_size=4)
    return outputs(engine, greedy())


def draft_engine(make_engine, draft: str, **config):
    config.setdefault("num_speculative_tokens", 3)
    return make_engine(
        block_size=4, speculative_method="draft", speculative_draft_model=draft, **config
    )


CONFIGS = [
    dict(),
    dict(long_prefill_token_threshold=5),  # chunked prefill
    dict(num_kv_blocks=14),  # preemption
    dict(overlap_schedule=True),
    dict(prefix_cache="none"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_greedy_identical_with_the_target_as_draft(make_engine, tiny_model_dir, reference, config):
    engine = draft_engine(make_engine, tiny_model_dir, **config)
    assert outputs(engine, greedy()) == reference
    s = engine.stats()
    assert s["spec_draft_tokens"] > 0
    assert s["spec_acceptance_rate"] == 1.0  # the same model drafts the same argmax
    if config.get("num_kv_blocks"):
        assert s["preemptions"] > 0


def test_greedy_identical_with_a_random_draft(make_engine, tiny_random_model_dir, reference):
    engine = draft_engine(make_engine, tiny_random_model_dir, num_speculative_tokens=4)
    assert outputs(engine, greedy()) == reference
    s = engine.stats()
    assert s["spec_draft_tokens"] > 0 and s["spec_acceptance_rate"] < 0.2


def test_cached_prefix_has_draft_kv(make_engine, tiny_model_dir, reference):
    """The second run matches the first run's prompts and outputs in the radix tree; with
    the target as draft any missing draft KV would show up as a rejected draft."""
    engine = draft_engine(make_engine, tiny_model_dir)
    assert outputs(engine, greedy()) == reference
    first = engine.stats()
    assert outputs(engine, greedy()) == reference
    s = engine.stats()
    assert s["cached_tokens"] > first["cached_tokens"]
    assert s["spec_draft_tokens"] > first["spec_draft_tokens"]
    assert s["spec_acceptance_rate"] == 1.0


def test_sampling_with_draft(make_engine, tiny_model_dir, tiny_random_model_dir):
    """Seeded sampling is reproducible (per-request noise); the target as its own draft
    (p == q) accepts (almost) every draft; per-request counters add up to the totals."""
    same = draft_engine(make_engine, tiny_model_dir)
    first = outputs(same, seeded())
    assert outputs(same, seeded()) == first
    assert same.stats()["spec_acceptance_rate"] > 0.97
    other = draft_engine(make_engine, tiny_random_model_dir, num_speculative_tokens=2)
    prompts = [other.tokenizer.encode(t) for t in TEXTS]
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, top_k=20, min_p=0.02, ignore_eos=True)
        for _ in prompts
    ]
    rids, last = last_deltas(other, prompts, params)
    s = other.stats()
    assert all(last[r].num_output_tokens == 12 for r in rids)
    assert sum(last[r].num_draft_tokens for r in rids) == s["spec_draft_tokens"] > 0
    assert sum(last[r].num_accepted_tokens for r in rids) == s["spec_accepted_tokens"]


def test_abort_during_draft_speculation(make_engine, tiny_model_dir):
    engine = draft_engine(make_engine, tiny_model_dir, num_kv_blocks=20)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    rids = [engine.add_request(p, SamplingParams(max_tokens=30, temperature=0)) for p in ids]
    for _ in range(3):
        engine.step()
    engine.abort(rids[0])
    engine.abort(rids[2])
    while engine.core.has_work:
        engine.step()
    engine.check_integrity()


def test_bad_draft_checkpoints_fail_at_startup(make_engine, tiny_model_dir, tmp_path):
    from radixrt.model.tiny import make_hf_checkpoint

    small = make_hf_checkpoint(str(tmp_path / "v1000"), "llama", vocab_size=1000)
    with pytest.raises(ValueError, match="vocab_size 1000"):
        draft_engine(make_engine, small)
    # same vocab size, two token ids swapped: a different tokenizer
    swapped = str(tmp_path / "swapped")
    shutil.copytree(tiny_model_dir, swapped)
    path = os.path.join(swapped, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(path, "w") as f:
        json.dump(tok, f)
    with pytest.raises(ValueError, match="different tokenizer"):
        draft_engine(make_engine, swapped)
    with pytest.raises(FileNotFoundError, match="speculative_draft_model: no config.json"):
        draft_engine(make_engine, str(tmp_path / "missing"))


def penalised() -> list[SamplingParams]:
    kinds = [
        dict(temperature=0, frequency_penalty=2.0),
        dict(temperature=0, repetition_penalty=1.5, presence_penalty=1.5),
        dict(temperature=0.8, frequency_penalty=1.5, seed=11),
        dict(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.4, seed=5),
    ]
    return [SamplingParams(max_tokens=24, ignore_eos=True, **k) for k in kinds]


@pytest.mark.parametrize("method", ["ngram", "radix", "draft"])
def test_penalties_count_the_drafts_before_each_position(make_engine, tiny_model_dir, method):
    """Rows with penalties draft; each position is penalised with the drafts before it
    counted, so outputs equal speculation off (greedy and, for host drafts, seeded sampling;
    draft-model rows sample by rejection: greedy rows only are compared there). Counting no
    drafts fails the draft case (checked by hand: the target drafts for itself, so most
    drafts are accepted and later positions see them)."""
    plain = make_engine(block_size=4)
    expected = outputs(plain, penalised())
    extra = {"speculative_draft_model": tiny_model_dir} if method == "draft" else {}
    engine = make_engine(
        block_size=4, speculative_method=method, num_speculative_tokens=3, ngram_min_n=1, **extra
    )
    for _ in range(2):  # the second run: radix drafts from the tree
        got = outputs(engine, penalised())
        compared = 2 if method == "draft" else 4
        assert got[:compared] == expected[:compared]
    s = engine.stats()
    assert s["spec_draft_tokens"] > 0
    if method == "draft":  # (penalised outputs rarely repeat: ngram drafts are rejected)
        assert s["spec_accepted_tokens"] > s["spec_draft_tokens"] / 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_draft_model_greedy_and_sampling(make_engine, tiny_model_dir):
    """CUDA, flashinfer, bf16, CUDA graphs and overlap on: the target as its own draft
    accepts (nearly) every greedy draft and its greedy outputs agree with speculation off
    up to bf16 near ties (the verify rows run through the prefill kernel, the draft steps
    through the draft's decode graphs); seeded sampling is reproducible."""
    opts = dict(device="cuda", dtype="bfloat16", num_kv_blocks=512)
    plain = make_engine(**opts)
    engine = make_engine(
        speculative_method="draft",
        speculative_draft_model=tiny_model_dir,
        num_speculative_tokens=4,
        **opts,
    )
    prompts = [plain.tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    got = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=params)]
    same = sum(a[:8] == b[:8] for a, b in zip(ref, got))
    assert same >= len(prompts) - 1
    assert engine.stats()["spec_acceptance_rate"] > 0.9
    # reproducible seeded sampling: no cache, so both runs compute exactly the same batches
    uncached = make_engine(
        speculative_method="draft",
        speculative_draft_model=tiny_model_dir,
        prefix_cache="none",
        **opts,
    )
    first = outputs(uncached, seeded())
    assert outputs(uncached, seeded()) == first


def test_runner_draft_rejection_sampling_first_token_distribution(
    make_engine, tiny_random_model_dir
):
    """The runner's whole draft path (q from the random draft model on the device, p from
    the target with temperature and top-k, rejection): over N identical verify rows, the
    first output token (accepted draft 1 or the residual sample) is distributed as the
    target's p at that position (chi-square, ALPHA; the rows share one block table:
    attention at the first verify position reads only the shared context). Sampling a
    rejected position from p instead of max(0, p - q) fails it (p-value ~1e-14, checked by
    hand)."""
    from scipy.stats import chisquare

    from radixrt.plan import PlanRow, SlotEntry, StepPlan

    num_rows, alpha = 3000, 1e-3
    engine = make_engine(
        prefix_cache="none",
        block_size=4,
        num_kv_blocks=16,
        max_running_requests=num_rows,
        speculative_method="draft",
        speculative_draft_model=tiny_random_model_dir,
    )
    runner = engine.core.runner
    ctx = engine.tokenizer.encode("Once upon a time there was a")
    n = len(ctx) - 1  # the context's KV; ctx[-1] is each verify row's first input
    blocks = list(range(-(-(n + 3) // 4)))
    params = SamplingParams(temperature=0.9, top_k=40, max_tokens=8)

    def plan_row(slot, start, ids, samples, **kw):
        return PlanRow(
            rid=f"r{slot}",
            slot=slot,
            start=start,
            num_tokens=len(ids),
            input_ids=list(ids),
            new_blocks=blocks,
            sample_offsets=samples,
            **kw,
        )

    entries = [SlotEntry(i, runner.slots.incarnations[i] + 1, params) for i in range(num_rows)]
    first_plan = StepPlan(0, [plan_row(0, 0, ctx[:n], [])], new_slots=entries)
    runner.execute(first_plan).result()  # target + draft KV
    logits = runner.logits(StepPlan(1, [plan_row(0, n, ctx[n:], [0])]))[0]
    p = torch.softmax(logits / 0.9, dim=-1)
    p[p < p.topk(40).values[-1]] = 0
    p /= p.sum()
    rows = [plan_row(i, n, [ctx[-1]], [0, 1, 2], num_draft_tokens=2) for i in range(num_rows)]
    for r in rows:
        r.num_tokens = 3
    result = runner.execute(StepPlan(2, rows, device_drafts=list(range(num_rows)))).result()
    first = torch.tensor([t[0] for t in result.tokens])
    assert (p[first] > 0).all()
    observed = torch.bincount(first, minlength=p.numel()).double()
    expected = p.double() * num_rows
    big = expected >= 5  # the rest pooled into one cell (those that p gives mass to)
    rest = (~big) & (p > 0)
    obs, exp = observed[big], expected[big]
    if rest.any():
        obs = torch.cat([obs, observed[rest].sum().view(1)])
        exp = torch.cat([exp, expected[rest].sum().view(1)])
    exp *= obs.sum() / exp.sum()  # float32 p: renormalise exactly
    assert float(chisquare(obs.numpy(), exp.numpy()).pvalue) > alpha
    accepted = sum(len(t) - 1 for t in result.tokens)
    assert 0 < accepted < 2 * num_rows  # a random draft: some but not all accepted


def test_stop_token_and_logprobs_inside_an_accepted_run(make_engine, tiny_model_dir, reference):
    """A stop token inside a run of accepted drafts ends the output at that token (the rest
    dropped), and log-probs of accepted tokens equal plain decoding's."""
    plain = make_engine(block_size=4)
    engine = draft_engine(make_engine, tiny_model_dir, num_speculative_tokens=4)
    prompts = [plain.tokenizer.encode(t) for t in TEXTS]
    stops = [ref[6] for ref in reference]  # the 7th greedy token of each prompt
    params = [
        SamplingParams(
            max_tokens=20, temperature=0, stop_token_ids=[s], logprobs=True, ignore_eos=True
        )
        for s in stops
    ]
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    got = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    engine.check_integrity()
    for w, g, stop in zip(want, got, stops):
        assert g.token_ids == w.token_ids and g.token_ids[-1] == stop
        assert g.finish_reason == w.finish_reason
        torch.testing.assert_close(g.logprobs, w.logprobs, rtol=1e-4, atol=1e-4)
    assert engine.stats()["dropped_tokens"] > 0


def test_draft_graph_step_plumbing(make_engine, tiny_model_dir, reference):
    """The draft's CUDA-graph step path on CPU with a stand-in for DecodeCudaGraphs that
    runs eagerly from the same inputs (`run(layout, tables, last_tokens, callback)`, input
    ids read from last_tokens by slot): outputs and acceptance as the eager path."""
    engine = draft_engine(make_engine, tiny_model_dir, num_speculative_tokens=3)
    runner = engine.core.runner
    draft = runner.draft
    calls = []

    class EagerGraphs:
        def can_run(self, plan, layout):
            return layout.num_decode == len(plan.rows)

        def run(self, layout, tables, last_tokens, on_inputs_staged):
            assert (tables == runner.block_tables[layout.slots]).all()
            fb = runner.build_batch(layout)
            fb.input_ids = last_tokens[torch.from_numpy(layout.slots)]
            draft.backend.prepare(fb)
            on_inputs_staged()
            calls.append(len(layout.slots))
            return draft.model.compute_logits(draft.model(fb, draft.backend, draft.pool))

    draft.cuda_graphs = EagerGraphs()
    draft.last_tokens = torch.zeros(runner.num_slots, dtype=torch.int64)
    assert outputs(engine, greedy()) == reference
    assert calls and engine.stats()["spec_acceptance_rate"] == 1.0


def test_verify_rows_as_decode_rows_with_device_drafts(make_engine, tiny_model_dir, reference):
    """The target's graph path for verify rows whose drafts are on the device (the draft
    model's): run eagerly on CPU from the graphs' host metadata (tests/eager_decode_graphs),
    the drafts written as device inputs. Greedy output as without speculation; the target as
    its own draft accepts everything, so a misplaced draft id would show."""
    from eager_decode_graphs import EagerDecodeGraphs

    engine = draft_engine(make_engine, tiny_model_dir, num_speculative_tokens=3)
    graphs = engine.core.runner.cuda_graphs = EagerDecodeGraphs(engine.core.runner)
    assert outputs(engine, greedy()) == reference
    assert any(tokens > rows for rows, tokens, _ in graphs.calls)
    assert engine.stats()["spec_acceptance_rate"] == 1.0
