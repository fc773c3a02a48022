"""Per-slot runner state: slot entries set it, forks copy it, the runner counts its own samples
(penalties on the device), the row sampler keeps each plain row's last sample in its slot, and
a slot granted again while a step of its old sequence is in flight gets none of that step's
tokens. Penalties from per-slot counts equal the per-row host implementation
(`sampler.apply_penalties`) float for float."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_step_plan import expected, make_core, prompts

from radixrt import SamplingParams
from radixrt.executor.inputs import general_layout, layout_plan
from radixrt.executor.penalties import SlotPenalties
from radixrt.executor.row_sampling import RowSampler
from radixrt.executor.runner_features import RunnerFeature, StepContext
from radixrt.executor.sampler import apply_penalties
from radixrt.executor.slots import SlotState
from radixrt.plan import PlanRow, SlotEntry, StepPlan
from radixrt.scheduler.request import RequestStatus

VOCAB = 64
KINDS = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1),
    dict(),  # no penalties: left alone
]


def _random_case(seed: int, kinds: list[dict] = KINDS):
    """Slots with prompts / outputs, a plan of decode and verify rows (host drafts)."""
    rng = random.Random(seed)
    num_slots = 6
    params = [SamplingParams(**kinds[s % len(kinds)]) for s in range(num_slots)]
    prompt = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))] for _ in params]
    output = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 9))] for _ in params]
    rows, drafts = [], {}
    for s in range(num_slots):
        k = rng.choice([0, 0, 2, 3])
        n = 1 + k
        rows.append(PlanRow(f"r{s}", s, 20, n, [1], sample_offsets=list(range(n - 1 - k, n))))
        rows[-1].num_draft_tokens = k
        if k:
            drafts[len(rows) - 1] = [rng.randrange(VOCAB) for _ in range(k)]
    plan = StepPlan(0, rows, drafts=drafts)
    return params, prompt, output, plan


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kinds", ["mixed", *range(4)])
def test_penalties_from_slot_counts_equal_the_host_reference(device, seed, kinds):
    """Every kind of penalty, mixed with rows without any; and batches whose every row has
    the same kind (the penalties then run on the logits in place, terms left out where 0).
    On CUDA too, float for float (the reference divides by a Python scalar, which CUDA
    computes as a product with the float32 reciprocal)."""
    params, prompt, output, plan = _random_case(seed, KINDS if kinds == "mixed" else [KINDS[kinds]])
    dev = torch.device(device)
    pen = SlotPenalties(len(params), VOCAB, dev)
    pen.enter(
        [
            SlotEntry(s, 1, p, prompt_ids=prompt[s], output_ids=output[s])
            for s, p in enumerate(params)
        ]
    )
    layout = general_layout(plan, params)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(layout.sample_tokens), VOCAB, generator=gen).to(dev)
    ref = logits.clone()
    # the reference: each sample counts its row's output plus the drafts before it
    outs = []
    for s_idx, i in enumerate(layout.sample_rows.tolist()):
        j = s_idx - int(layout.row_first_sample[i])
        outs.append(output[plan.rows[i].slot] + plan.row_drafts(i)[:j])
    prompts_ = [prompt[plan.rows[i].slot] for i in layout.sample_rows.tolist()]
    apply_penalties(ref, layout.sample_params, prompts_, outs)
    pen.apply(logits, plan, layout, pen.penalised(layout))
    assert torch.equal(logits, ref)


def test_counts_follow_accepted_samples_and_copies():
    """`count` adds a plain row's sample and a verify row's accepted ones; a fork's entry
    copies the slot as it was before the plan's entries, then adds its own tokens."""
    p = SamplingParams(frequency_penalty=1.0)
    pen = SlotPenalties(4, VOCAB, torch.device("cpu"))
    pen.enter([SlotEntry(0, 1, p, output_ids=[3, 3]), SlotEntry(1, 2, p)])
    rows = [PlanRow("a", 0, 5, 1, [], True, sample_offsets=[0])]
    rows.append(PlanRow("b", 1, 5, 3, [7], sample_offsets=[0, 1, 2], num_draft_tokens=2))
    plan = StepPlan(1, rows, drafts={1: [9, 10]})
    layout = general_layout(plan, [p] * 4)
    tokens = torch.tensor([5, 9, 11, 12])  # row b: draft 9 accepted, then 11; 12 unused
    pen.count(layout, tokens, [1], torch.tensor([1]))
    assert pen.output_counts[0].tolist() == np.bincount([3, 3, 5], minlength=VOCAB).tolist()
    assert pen.output_counts[1].tolist() == np.bincount([9, 11], minlength=VOCAB).tolist()
    # slot 0 is copied into 2 and 0 (child 0 keeps it), each adding a token on top
    pen.enter(
        [
            SlotEntry(0, 3, p, copy_from=0, output_ids=[1]),
            SlotEntry(2, 4, p, copy_from=0, output_ids=[2]),
        ]
    )
    assert pen.output_counts[0].tolist() == np.bincount([3, 3, 5, 1], minlength=VOCAB).tolist()
    assert pen.output_counts[2].tolist() == np.bincount([3, 3, 5, 2], minlength=VOCAB).tolist()
    pen.enter([SlotEntry(0, 5, SamplingParams())])  # a sequence without penalties
    assert not pen.active[0] and pen.active[2]


def test_row_sampler_verifies_drafts_and_keeps_last_samples_of_plain_rows():
    """A RowSampler built from its parts alone: greedy samples, the exact-match verification
    of a row's host drafts, the features' hooks around sampling, and each plain row's sample
    in its slot of `last_tokens` (a drafting row's slot is left alone)."""
    slots = SlotState(4, 4, 16, torch.device("cpu"))
    greedy = SamplingParams(temperature=0)
    slots.enter([SlotEntry(s, 1, greedy) for s in range(3)])
    seen = []

    class Recorder(RunnerFeature):
        def on_logits(self, ctx, logits):
            seen.append(("on_logits", list(ctx.drafting)))

        def after_sample(self, ctx, logits, out):
            seen.append(("after_sample", out.num_accepted.tolist()))

    sampler = RowSampler(torch.device("cpu"), slots, [Recorder()], (VOCAB - 1,), None)
    rows = [PlanRow("a", 0, 5, 1, [], True, sample_offsets=[0])]
    rows.append(PlanRow("b", 1, 5, 3, [7], sample_offsets=[0, 1, 2], num_draft_tokens=2))
    rows.append(PlanRow("c", 2, 5, 1, [], True, sample_offsets=[0]))
    plan = StepPlan(1, rows, drafts={1: [9, 10]})
    layout = layout_plan(plan, slots.params)
    want = [5, 9, 11, 12, 7]  # row b: draft 9 accepted, 10 is not (11 sampled there)
    logits = torch.zeros(len(want), VOCAB)
    logits[torch.arange(len(want)), torch.tensor(want)] = 1.0
    before = slots.last_tokens.clone()
    out = sampler.sample(StepContext(plan, layout, False), logits)
    assert out.tokens.tolist() == want
    assert out.num_accepted.tolist() == [1]
    assert seen == [("on_logits", [1]), ("after_sample", [1])]
    assert slots.last_tokens[[0, 2]].tolist() == [5, 7]
    assert torch.equal(slots.last_tokens[[1, 3]], before[[1, 3]])


def test_preempt_and_readmit_into_the_same_slot_while_in_flight():
    """Overlap: r0 is preempted while a step holding its row is in flight and re-admitted
    into the same slot before that step's result is taken. The new incarnation's entry
    carries r0's host output; the in-flight step's sample is not counted in the slot (the
    scripted runner counts results when taken); every step, each running penalised slot
    counts exactly its request's host output; outputs equal plain decoding."""
    core, runner = make_core(overlap=True, max_running_requests=2)
    params = [SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=0.5)] * 2
    reqs = prompts(2)
    rids = [core.add_request(p, sp, rid=f"r{i}") for i, (p, sp) in enumerate(zip(reqs, params))]
    out = {rid: [] for rid in rids}
    readmitted = False
    while core.has_work:
        for d in core.step():
            out[d.rid] += d.new_token_ids
        runner.check_slots(core.scheduler.running)
        r0 = core.request("r0")
        if not readmitted and r0 is not None and r0.num_output >= 2 and core._inflight:
            assert r0.num_inflight_samples == 1  # its row is in the step in flight
            slot, incarnation = r0.slot, r0.slot_incarnation
            core.scheduler.lifecycle.preempt(r0)
            for d in core.step():  # re-admits r0 (LIFO free slots: the same slot)
                out[d.rid] += d.new_token_ids
            assert r0.status is RequestStatus.RUNNING and r0.slot == slot
            assert r0.slot_incarnation > incarnation
            readmitted = True
    core.check_integrity()
    assert readmitted and runner.num_stale_results > 0
    assert core.stats()["preemptions"] == 1
    want = expected(reqs, [8, 8])
    assert {rid: (toks, reason) for rid, (toks, reason) in want.items()} == {
        rid: (out[rid], want[rid][1]) for rid in rids
    }


def test_model_runner_slot_counts_and_preemption_in_flight(make_engine):
    """The CPU ModelRunner: greedy penalised outputs are the same whether or not a request
    is preempted and re-admitted (same slot) while a step holding it is in flight; without
    overlap every running slot's device counts equal its host output; n > 1 children start
    from their parent's copied slot."""
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=1.2),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.4, n=2),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=0.9),
    ]
    texts = ["the the the cat", "a b a b a b", "hello hello world"]
    plain = make_engine(block_size=4, overlap_schedule=False)
    ids = [plain.tokenizer.encode(t) for t in texts]
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ids, sampling_params=params)]

    # counts after every step (no overlap: every result is on the host)
    core = plain.core
    for p, sp in zip(ids, params):
        core.add_request(p, sp)
    pen = core.runner.penalties
    while core.has_work:
        core.step()
        for req in core.scheduler.running:
            if req.num_output:
                got = pen.output_counts[req.slot].tolist()
                naive = np.bincount(req.output_token_ids, minlength=len(got)).tolist()
                assert got == naive, req.rid
            prompt_seen = set(np.flatnonzero(pen.prompt_seen[req.slot].numpy()).tolist())
            if req.params.repetition_penalty != 1.0:
                assert prompt_seen == set(req.prompt_token_ids)

    engine = make_engine(block_size=4, overlap_schedule=True)
    core = engine.core
    rids = [core.add_request(p, sp) for p, sp in zip(ids, params)]
    out: dict[str, list[int]] = {}
    done = False
    while core.has_work:
        for d in core.step():
            out.setdefault(d.rid, []).extend(d.new_token_ids)
        req = core.request(rids[0])
        if not done and req is not None and req.num_output >= 3 and core._inflight:
            assert req.num_inflight_samples == 1
            slot = req.slot
            core.scheduler.lifecycle.preempt(req)
            for d in core.step():
                out.setdefault(d.rid, []).extend(d.new_token_ids)
            assert req.slot == slot
            done = True
    assert done
    got = [out[rids[0]], out[f"{rids[1]}#0"], out[f"{rids[1]}#1"], out[rids[2]]]
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_penalised_and_speculating_rows_overlap(make_engine):
    """CUDA, graphs, overlap on: penalised greedy outputs equal overlap off (the same
    batches); an ngram engine's agree up to bf16 near ties (verify rows run other kernels)."""
    opts = dict(device="cuda", dtype="bfloat16", num_kv_blocks=512, prefix_cache="none")
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=1.0),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    ]
    texts = ["the cat sat on the mat. the cat sat on", "1 2 3 4 1 2 3 4 1", "Once upon a"]
    sync = make_engine(overlap_schedule=False, **opts)
    ids = [sync.tokenizer.encode(t) for t in texts]
    want = [o.token_ids for o in sync.generate(prompt_token_ids=ids, sampling_params=params)]
    engine = make_engine(overlap_schedule=True, **opts)
    got = [o.token_ids for o in engine.generate(prompt_token_ids=ids, sampling_params=params)]
    assert got == want
    spec = make_engine(overlap_schedule=True, speculative_method="ngram", ngram_min_n=1, **opts)
    got = [o.token_ids for o in spec.generate(prompt_token_ids=ids, sampling_params=params)]
    assert sum(a[:8] == b[:8] for a, b in zip(got, want)) >= len(want) - 1
    assert spec.stats()["spec_draft_tokens"] > 0
