"""n > 1 forks and beam search on the plain-Python scheduler with a content-modelling scripted
runner: block references, copy-on-write, group preemption and abort, integrity every step."""

from __future__ import annotations

import math
import random

import pytest
from test_step_plan import EOS, make_core

from radixrt.deltas import FinishReason
from radixrt.sampling import BeamSearchParams, SamplingParams
from radixrt.scheduler.beam import BeamState
from radixrt.scheduler.request import fork_rid


def ctx_token(rid: str, context) -> int:
    """The sample after `context` (read back from the modelled KV) for request `rid`."""
    return 7 + hash((rid, tuple(context))) % 1000


def expect(rid: str, prompt: list[int], m: int) -> list[int]:
    seq = list(prompt)
    for _ in range(m):
        seq.append(ctx_token(rid, seq))
    return seq[len(prompt) :]


def content_core(**kw):
    core, runner = make_core(**kw)
    runner.context_fn = ctx_token
    return core, runner


def drive(core, on_step=None) -> dict[str, tuple[list[int], FinishReason]]:
    out: dict[str, list[int]] = {}
    done = {}
    while core.has_work:
        for d in core.step():
            out.setdefault(d.rid, []).extend(d.new_token_ids)
            if d.finished:
                done[d.rid] = (out[d.rid], d.finish_reason, d)
        core.check_integrity()
        if on_step is not None:
            on_step()
    core.check_integrity()
    assert core.allocator.num_free + core.cache.cached_blocks == core.allocator.num_blocks
    return done


PROMPTS = [list(range(100, 109)), list(range(100, 111)), [5] * 12, [9, 8]]

CONFIGS = [
    dict(),
    dict(prefix_cache="none"),
    dict(prefix_cache="blockhash"),
    dict(max_num_batched_tokens=8),
    dict(num_kv_blocks=16),  # preemption
    dict(num_kv_blocks=26, block_size=2, max_num_batched_tokens=8, prefix_cache="none"),
    dict(max_running_requests=4),
    dict(block_size=1, policy="fcfs"),
]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_fork_children_read_their_own_kv(overlap, config):
    """Children of n > 1 requests (mixed with plain ones) produce exactly what their own
    context implies: the shared prefix and the copied partial block hold the right tokens."""
    core, runner = content_core(overlap=overlap, **config)
    n_of = [3, 1, 2, 4]
    for i, (p, n) in enumerate(zip(PROMPTS, n_of)):
        core.add_request(p, SamplingParams(max_tokens=6 + i, ignore_eos=True, n=n), rid=f"r{i}")
    done = drive(core)
    want = {}
    for i, (p, n) in enumerate(zip(PROMPTS, n_of)):
        rids = [f"r{i}"] if n == 1 else [fork_rid(f"r{i}", c) for c in range(n)]
        for c, rid in enumerate(rids):
            want[rid] = expect(rid, p, 6 + i)
            assert done[rid][2].index == c
            assert done[rid][2].parent_rid == (None if n == 1 else f"r{i}")
    assert {rid: v[0] for rid, v in done.items()} == want
    if config.get("num_kv_blocks"):
        assert core.stats()["preemptions"] > 0


@pytest.mark.parametrize("prefix_cache", ["none", "radix", "blockhash"])
def test_fork_shares_full_blocks_and_copies_the_partial_one(prefix_cache):
    n, bs = 4, 4
    prompt = list(range(200, 211))  # the parent computes 10 tokens: 2 full blocks + 2 tokens
    core, runner = content_core(overlap=False, prefix_cache=prefix_cache, block_size=bs)
    core.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True, n=n), rid="p")
    sched = core.scheduler
    checked = []

    def check():
        kids = [r for r in sched.running if r.group is not None and r is not r.group.parent]
        if len(kids) == n and not checked:
            full = kids[0].block_table[:2]
            assert all(k.block_table[:2] == full for k in kids)
            held = core.cache.held_refs()
            for b in full:
                assert core.allocator.ref_counts[b] == n + held.get(b, 0)
            partial = {k.block_table[2] for k in kids}
            assert len(partial) == n  # each child has its own last block
            checked.append(True)

    done = drive(core, check)
    assert checked
    assert [op.num_tokens for op in runner.copies if op.num_tokens == 2] == [2] * (n - 1)
    stats = core.stats()
    assert stats["fork_copied_blocks"] == n - 1 and stats["fork_shared_blocks"] == 2 * (n - 1)
    # the prompt's first 10 tokens are computed once, each child feeds the 11th itself
    assert stats["prompt_tokens_computed"] == 10 + n
    assert runner.num_computed_tokens == 10 + n * 5
    for c in range(n):
        rid = fork_rid("p", c)
        assert done[rid][0] == expect(rid, prompt, 5)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("when", [0, 1, 4])
def test_abort_parent_frees_every_child(overlap, when):
    core, _ = content_core(overlap=overlap)
    core.add_request(list(range(100, 111)), SamplingParams(max_tokens=30, n=3), rid="p")
    core.add_request(list(range(300, 305)), SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(when):
        core.step()
    assert core.abort("p") is None  # the children's last deltas come with the next step
    last = {}
    while core.has_work:
        for d in core.step():
            if d.parent_rid == "p":
                assert d.finish_reason is FinishReason.ABORT and d.rid not in last
                last[d.rid] = d
        core.check_integrity()
    assert set(last) == {fork_rid("p", c) for c in range(3)}
    assert core.abort("p") is None and core.abort(fork_rid("p", 0)) is None
    assert core.allocator.num_free + core.cache.cached_blocks == core.allocator.num_blocks


def test_abort_one_child_keeps_the_others():
    core, _ = content_core(overlap=True)
    prompt = list(range(100, 111))
    core.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True, n=3), rid="p")
    early: dict[str, list[int]] = {}
    for _ in range(4):
        for d in core.step():
            early.setdefault(d.rid, []).extend(d.new_token_ids)
    assert core.abort(fork_rid("p", 1)).finish_reason is FinishReason.ABORT
    done = drive(core)
    for c in (0, 2):
        rid = fork_rid("p", c)
        assert early.get(rid, []) + done[rid][0] == expect(rid, prompt, 8)
    assert fork_rid("p", 1) not in done


def test_group_preemption_recomputes_the_prefix_once():
    """A pool that holds about one group at a time: groups preempt each other as a whole;
    after each re-admission the parent alone recomputes the shared prefix (once), each child
    only its own suffix."""
    core, runner = content_core(overlap=False, prefix_cache="none", num_kv_blocks=12)
    plans = []
    execute = runner.execute
    runner.execute = lambda plan: (plans.append(plan), execute(plan))[1]
    prompts = [list(range(100 + 20 * i, 111 + 20 * i)) for i in range(3)]
    for i, p in enumerate(prompts):
        core.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True, n=2), rid=f"g{i}")
    done = drive(core)
    for i, p in enumerate(prompts):
        for c in range(2):
            rid = fork_rid(f"g{i}", c)
            assert done[rid][0] == expect(rid, p, 12)
    s = core.scheduler.stats
    assert s.preemptions > 0 and s.forks > 3  # some group forked again
    rows = [r for plan in plans for r in plan.rows]
    assert all(r.end <= 10 for r in rows if "#" not in r.rid)  # parents: the shared prefix
    assert all(r.start >= 10 for r in rows if "#" in r.rid)  # children: their own suffix
    # a child re-admitted after preemption feeds its whole suffix in one row
    assert any(r.start == 10 and r.num_tokens > 1 for r in rows if "#" in r.rid)


def test_n_too_large_for_the_pool_or_slots_is_rejected():
    core, _ = content_core(overlap=False, num_kv_blocks=16, max_running_requests=8)
    with pytest.raises(ValueError, match="n=6"):
        core.add_request(list(range(30)), SamplingParams(max_tokens=40, n=6))
    with pytest.raises(ValueError, match="n=9"):
        core.add_request([1, 2, 3], SamplingParams(max_tokens=1, n=9))
    with pytest.raises(ValueError, match="n"):
        SamplingParams(n=0)
    assert not core.scheduler.requests and not core.scheduler.waiting


# ---- beam search ----
VOCAB_LO, VOCAB_HI = 4, 40


def beam_tops(context, k: int = 20) -> list[tuple[int, float]]:
    """Deterministic top-k log-probs after `context` (EOS among them now and then)."""
    rng = random.Random(hash(tuple(context)))
    toks = rng.sample(range(VOCAB_LO, VOCAB_HI), k)
    if rng.random() < 0.3:
        toks[rng.randrange(k)] = EOS
    lps = sorted((-rng.expovariate(1.5) for _ in toks), reverse=True)
    return list(zip(toks, lps))


def reference_beams(prompt, params: BeamSearchParams, eos=(EOS,)):
    k = params.num_candidates(len(eos))
    state = BeamState(
        params.beam_width,
        k,
        params.max_tokens,
        params.length_penalty,
        frozenset() if params.ignore_eos else frozenset(eos),
    )
    outputs: list[list[int]] = [[]]
    while True:
        picks = state.step(outputs, [beam_tops(prompt + o)[:k] for o in outputs])
        if not picks:
            return state.finished
        outputs = [outputs[c.beam] + [c.token] for c in picks]


BEAM_CONFIGS = [
    dict(),
    dict(prefix_cache="none"),
    dict(prefix_cache="blockhash", block_size=2),
    dict(num_kv_blocks=20, max_num_batched_tokens=6),  # preemption, chunked recompute
    dict(num_kv_blocks=20, block_size=2, prefix_cache="none"),
]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("config", BEAM_CONFIGS, ids=[str(c) for c in BEAM_CONFIGS])
def test_beam_search_plumbing(overlap, config):
    """Beams re-parented by block references and copies read the right KV: results equal
    BeamState driven directly; beams run in batches with plain requests."""
    core, runner = content_core(overlap=overlap, **config)
    runner.context_fn = lambda rid, ctx: beam_tops(ctx) if "#" in rid else ctx_token(rid, ctx)
    cases = [
        (list(range(100, 107)), BeamSearchParams(beam_width=3, max_tokens=7)),
        (list(range(120, 129)), BeamSearchParams(beam_width=2, max_tokens=9, length_penalty=0.5)),
        ([7, 8], BeamSearchParams(beam_width=4, max_tokens=5, ignore_eos=True)),
    ]
    for i, (p, bp) in enumerate(cases):
        core.add_beam_search(p, bp, rid=f"b{i}")
    core.add_request(list(range(60, 70)), SamplingParams(max_tokens=9, ignore_eos=True), rid="x")
    done = drive(core)
    for i, (p, bp) in enumerate(cases):
        ref = reference_beams(p, bp)
        got = done[f"b{i}"][2].beams
        assert [h.output_token_ids for h in got] == [h.output_token_ids for h in ref]
        assert [h.score for h in got] == pytest.approx([h.score for h in ref])
        assert len(got) == bp.beam_width
    assert done["x"][0] == expect("x", list(range(60, 70)), 9)
    stats = core.stats()
    assert stats["beam_copied_blocks"] + stats["beam_shared_blocks"] > 0
    if config.get("num_kv_blocks"):
        assert stats["preemptions"] > 0


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("num_kv_blocks", [14, 16])
def test_beams_in_a_tight_pool(overlap, num_kv_blocks):
    """Two beam searches and plain requests in a pool too small for all: groups preempt each
    other (also when a re-parenting step finds no block for a copy) and still produce the
    reference results."""
    core, runner = content_core(
        overlap=overlap, prefix_cache="none", num_kv_blocks=num_kv_blocks, block_size=4
    )
    runner.context_fn = lambda rid, ctx: beam_tops(ctx) if "#" in rid else ctx_token(rid, ctx)
    cases = [(list(range(100 + 20 * i, 107 + 20 * i)), BeamSearchParams(4, 7)) for i in range(2)]
    for i, (p, bp) in enumerate(cases):
        core.add_beam_search(p, bp, rid=f"b{i}")
    for j in range(3):
        p = list(range(60 + j, 66 + j))
        core.add_request(p, SamplingParams(max_tokens=9, ignore_eos=True), rid=f"x{j}")
    done = drive(core)
    for i, (p, bp) in enumerate(cases):
        ref = reference_beams(p, bp)
        got = done[f"b{i}"][2].beams
        assert [h.output_token_ids for h in got] == [h.output_token_ids for h in ref]
    for j in range(3):
        assert done[f"x{j}"][0] == expect(f"x{j}", list(range(60 + j, 66 + j)), 9)
    assert core.stats()["preemptions"] > 0


@pytest.mark.parametrize("when", [0, 2, 5])
def test_abort_mid_beam(when):
    core, runner = content_core(overlap=True)
    runner.context_fn = lambda rid, ctx: beam_tops(ctx)
    core.add_beam_search(list(range(100, 107)), BeamSearchParams(beam_width=4, max_tokens=20), "b")
    for _ in range(when):
        core.step()
        core.check_integrity()
    d = core.abort("b")
    assert d.finish_reason is FinishReason.ABORT and d.beams == []
    while core.has_work:
        assert not core.step()
    core.check_integrity()
    assert core.allocator.num_free + core.cache.cached_blocks == core.allocator.num_blocks


def test_beam_stopped_means_ended_on_eos_and_never_with_ignore_eos():
    """`BeamHypothesis.stopped` (the "stop" finish reason of a beam) is set exactly for beams
    that end on an EOS id; with ignore_eos a beam that happens to end on EOS at max_tokens
    ran to its length."""
    prompt = list(range(100, 108))
    for ignore_eos in (False, True):
        params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=ignore_eos)
        beams = reference_beams(prompt, params)
        assert beams
        for h in beams:
            ended_on_eos = h.output_token_ids[-1] == EOS
            assert h.stopped is (ended_on_eos and not ignore_eos)
            if not h.stopped:
                assert len(h.output_token_ids) == params.max_tokens
    ignoring = reference_beams(
        prompt, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    )
    assert not any(h.stopped for h in ignoring)


# ---- length penalties over their whole range ----
def test_length_penalised_is_hf_within_the_range_and_total_beyond():
    """Within |length_penalty| <= 10 and any length <= MAX_INT the score is HF's
    cumulative / length ** penalty exactly (so ranking is too); for any finite penalty it never
    raises and is finite, 0 or of the cumulative's sign, and ranks as the exact value does."""
    from radixrt.sampling import LENGTH_PENALTY_RANGE, MAX_INT
    from radixrt.scheduler.beam import length_penalised

    rng = random.Random(0)
    lengths = [1, 2, 3, 32, 1000, 2**20, MAX_INT]
    for penalty in [-LENGTH_PENALTY_RANGE, -2.5, -1.0, 0.0, 0.6, 1.0, 2.0, LENGTH_PENALTY_RANGE]:
        for length in lengths:
            for cumulative in (0.0, -1e-9, -3.5, -1e4 * rng.random(), -(2**31) * 104.0):
                got = length_penalised(cumulative, length, penalty)
                assert got == cumulative / length**penalty, (cumulative, length, penalty)
    for penalty in [1000.0, -1000.0, 300.0, -300.0, 1e300, -1e300, 10.5]:
        for length in lengths:
            scores = [length_penalised(c, length, penalty) for c in (-50.0, -5.0, -0.5, 0.0)]
            assert all(math.isfinite(s) and s <= 0 for s in scores)
            assert scores == sorted(scores)  # a better cumulative never scores worse
            assert scores[-1] == 0.0


@pytest.mark.parametrize("penalty", [1000.0, -1000.0, 300.0])
def test_beam_state_is_total_for_the_reported_penalties(penalty):
    """BeamState itself (below the parameter check) with the penalties that crashed the
    scheduler (OverflowError / ZeroDivisionError): the search ends with W finite scores."""
    state = BeamState(2, 4, 32, penalty, frozenset({EOS}))
    outputs: list[list[int]] = [[]]
    prompt = list(range(100, 107))
    while True:
        picks = state.step(outputs, [beam_tops(prompt + o)[:4] for o in outputs])
        if not picks:
            break
        outputs = [outputs[c.beam] + [c.token] for c in picks]
    assert state.done and len(state.finished) == 2
    assert all(math.isfinite(h.score) for h in state.finished)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("penalty", [-10.0, 10.0])
def test_beam_search_at_the_length_penalty_bounds(overlap, penalty):
    """The bounds of length_penalty with 32 tokens (the reported case's length) run through
    the scheduler like any other value: results equal BeamState driven directly."""
    core, runner = content_core(overlap=overlap)
    runner.context_fn = lambda rid, ctx: beam_tops(ctx) if "#" in rid else ctx_token(rid, ctx)
    params = BeamSearchParams(beam_width=2, max_tokens=32, length_penalty=penalty)
    prompt = list(range(100, 107))
    core.add_beam_search(prompt, params, "b")
    core.add_request(list(range(60, 70)), SamplingParams(max_tokens=9, ignore_eos=True), rid="x")
    done = drive(core)
    got, want = done["b"][2].beams, reference_beams(prompt, params)
    assert [h.output_token_ids for h in got] == [h.output_token_ids for h in want]
    assert [h.score for h in got] == [h.score for h in want]
    assert all(math.isfinite(h.score) for h in got) and len(got) == 2
    assert done["x"][1] is FinishReason.LENGTH
