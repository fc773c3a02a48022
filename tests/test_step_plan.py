"""The scheduler on plain Python with a scripted runner (no model), the plan boundary, overlap.

Tokens come from the ScriptedRunner's deterministic token function, so every configuration
(cache, chunking, preemption, overlap, speculation) must produce the same outputs.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from radixrt.config import EngineConfig, SchedulerConfig
from radixrt.deltas import FinishReason
from radixrt.engine.core import EngineCore
from radixrt.sampling import SamplingParams
from radixrt.speculative.base import Proposer
from radixrt.testing import ScriptedRunner, default_token, scripted_model_config

MODEL = scripted_model_config(2048, 256)
EOS = 3


def make_core(
    *,
    overlap: bool,
    prefix_cache: str = "radix",
    num_kv_blocks: int = 64,
    block_size: int = 4,
    proposer=None,
    **sched: object,
) -> tuple[EngineCore, ScriptedRunner]:
    sched_cfg = SchedulerConfig(**{"policy": "lpm", **sched})
    cfg = EngineConfig(model_path="-", overlap_schedule=overlap, scheduler=sched_cfg)
    cfg = replace(cfg, cache=replace(cfg.cache, prefix_cache=prefix_cache, block_size=block_size))
    runner = ScriptedRunner(sched_cfg.max_running_requests, block_size)
    core = EngineCore(cfg, MODEL, [EOS], runner=runner, num_kv_blocks=num_kv_blocks)
    runner.watch(core.scheduler)
    if proposer is not None:
        core.scheduler.use_proposer(proposer)
    return core, runner


def prompts(n: int = 10) -> list[list[int]]:
    shared = list(range(100, 130))
    return [shared[: 5 + 3 * i] + [500 + i] * (1 + i % 4) for i in range(n)]


def run(core: EngineCore, reqs, params) -> dict[str, tuple[list[int], FinishReason]]:
    rids = [core.add_request(p, sp, rid=f"r{i}") for i, (p, sp) in enumerate(zip(reqs, params))]
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    done = {}
    while core.has_work:
        for d in core.step():
            out[d.rid] += d.new_token_ids
            if d.finished:
                done[d.rid] = d.finish_reason
    core.check_integrity()
    assert core.allocator.num_free + core.cache.cached_blocks == core.allocator.num_blocks
    return {rid: (out[rid], done[rid]) for rid in rids}


def expected(reqs, max_tokens: list[int]) -> dict[str, tuple[list[int], FinishReason]]:
    """What any correct loop produces: default_token continued until max_tokens."""
    out = {}
    for i, (p, m) in enumerate(zip(reqs, max_tokens)):
        rid = f"r{i}"
        toks = [default_token(rid, len(p) + j) for j in range(m)]
        out[rid] = (toks, FinishReason.LENGTH)
    return out


CONFIGS = [
    dict(),
    dict(prefix_cache="none"),
    dict(prefix_cache="blockhash"),
    dict(max_num_batched_tokens=8),  # chunked prefill
    dict(long_prefill_token_threshold=3),
    dict(num_kv_blocks=14),  # preemption
    dict(num_kv_blocks=24, max_num_batched_tokens=8, block_size=2),
    dict(max_running_requests=3),
    dict(policy="dfs-weight"),
    dict(policy="fcfs", block_size=1),
]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_scripted_outputs_match_in_every_configuration(overlap, config):
    reqs = prompts()
    max_tokens = [1 + (i * 3) % 9 for i in range(len(reqs))]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    core, runner = make_core(overlap=overlap, **config)
    assert run(core, reqs, params) == expected(reqs, max_tokens)
    assert runner.overlapped() == overlap
    if config.get("num_kv_blocks"):
        assert core.stats()["preemptions"] > 0


def test_overlap_is_real():
    """With overlap, step N's result is taken only after step N + 1 was planned (and
    launched, when there was one); the sequential loop takes it before (so the same property
    fails there)."""
    for overlap in (True, False):
        core, runner = make_core(overlap=overlap)
        run(core, prompts(4), [SamplingParams(max_tokens=6, ignore_eos=True)] * 4)
        launches = sum(1 for kind, _ in runner.events if kind == "execute")
        assert launches >= 6
        assert runner.overlapped() is overlap
        if overlap:  # steady state: N + 1 is launched before N's result is taken
            ev = runner.events
            for n, (kind, i) in enumerate(ev):
                if kind == "result" and ("execute", i + 1) in ev:
                    assert ev.index(("execute", i + 1)) < n


def test_overlap_drops_the_token_after_a_stop():
    """EOS found when step N's result arrives: step N + 1 (already launched) sampled one more
    token for the row; it is dropped and the row's KV freed once."""
    stop_at = {"r0": 3, "r1": 1}

    def token_fn(rid: str, position: int) -> int:
        return EOS if position - 6 == stop_at.get(rid, -1) else 50 + position

    results = {}
    for overlap in (False, True):
        core, runner = make_core(overlap=overlap)
        runner.token_fn = token_fn
        params = [SamplingParams(max_tokens=8)] * 3
        out = run(core, [[9, 8, 7, 6, 5, 4]] * 3, params)
        results[overlap] = out
        if overlap:
            assert core.stats()["dropped_tokens"] >= 2
    assert results[True] == results[False]
    assert results[True]["r0"][1] is FinishReason.STOP and len(results[True]["r0"][0]) == 4
    assert results[True]["r2"][1] is FinishReason.LENGTH


def test_abort_while_in_flight_frees_once():
    core, runner = make_core(overlap=True)
    rids = [core.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts(6)]
    for _ in range(4):
        core.step()
    assert core.scheduler.num_inflight_steps == 1
    for rid in rids[::2]:
        assert core.abort(rid).finish_reason is FinishReason.ABORT
        assert core.abort(rid) is None  # a second abort frees nothing
    core.check_integrity()
    while core.has_work:
        for d in core.step():
            assert d.rid not in rids[::2], "an aborted request got tokens"
    core.check_integrity()


def test_penalised_rows_overlap():
    """Penalised rows do not wait for their result on the host: the runner counts their
    samples per slot (the plan carries the prompt once, in the slot entry), so they read their
    last sample on the device like the others."""
    core, runner = make_core(overlap=True)
    plans = []
    execute = runner.execute
    runner.execute = lambda plan: (plans.append(plan), execute(plan))[1]
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(max_tokens=6, ignore_eos=True),
    ]
    out = run(core, prompts(2), params)
    assert out == expected(prompts(2), [6, 6])
    for rid in ("r0", "r1"):
        assert any(r.reads_last_sample for p in plans for r in p.rows if r.rid == rid)
    assert not any(r.waits_for_result for p in plans for r in p.rows)
    entries = [e for p in plans for e in p.new_slots]
    assert len(entries) == 2
    penalised = next(e for e in entries if e.params.has_penalties)
    assert penalised.prompt_ids == prompts(2)[0] and penalised.output_ids == []
    plain = next(e for e in entries if not e.params.has_penalties)
    assert plain.prompt_ids == [] and plain.output_ids == []


class PrefixProposer(Proposer):
    """Drafts the true continuation for even positions' rows and garbage after it, so some
    drafts are accepted and some rejected."""

    def __init__(self, good: int) -> None:
        self.good = good

    def propose(self, tokens, max_drafts: int, salt=None) -> list[int]:
        # the rows of `prompts()`, rid f"r{row}"
        n = len(tokens)
        row = next(k for k, p in enumerate(prompts(16)) if list(tokens[: len(p)]) == p)
        true = [default_token(f"r{row}", n + i) for i in range(max_drafts)]
        return true[: self.good] + [1] * (max_drafts - self.good)


@pytest.mark.parametrize("good", [0, 2, 4])
@pytest.mark.parametrize("overlap", [False, True])
def test_speculative_rows_accept_and_roll_back(good, overlap):
    """Rows of k + 1 tokens, results of 1..k + 1 accepted tokens, block-table truncation:
    the outputs equal plain decoding and the pools balance."""
    reqs = prompts(6)
    max_tokens = [3 + 2 * i for i in range(6)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    core, runner = make_core(
        overlap=overlap, block_size=2, proposer=PrefixProposer(good), num_speculative_tokens=4
    )
    plans = []
    execute = runner.execute
    runner.execute = lambda plan: (plans.append(plan), execute(plan))[1]
    assert run(core, reqs, params) == expected(reqs, max_tokens)
    drafted = [r for p in plans for r in p.rows if r.num_draft_tokens]
    assert drafted and all(len(r.sample_offsets) == r.num_draft_tokens + 1 for r in drafted)
    assert all(r.waits_for_result for r in drafted)
    assert all(
        len(p.drafts[i]) == r.num_draft_tokens
        for p in plans
        for i, r in enumerate(p.rows)
        if r.num_draft_tokens
    )
    # rows that did not draft do not wait for their result
    assert not any(r.waits_for_result for p in plans for r in p.rows if not r.num_draft_tokens)
    steps_plain = sum(max_tokens)
    if good == 4:  # every draft right: far fewer decode rows than tokens
        assert sum(1 for p in plans for r in p.rows if r.sample_offsets) < steps_plain / 2


def test_hit_counters_count_each_prompt_once():
    core, _ = make_core(overlap=False, max_num_batched_tokens=8, max_running_requests=4)
    calls = []
    match = core.cache.match
    core.cache.match = lambda tokens, salt=None: (calls.append(len(tokens)), match(tokens, salt))[1]
    reqs = prompts(16)
    waiting_per_step = []
    schedule = core.scheduler.schedule

    def counting_schedule():
        waiting_per_step.append(len(core.scheduler.waiting))
        return schedule()

    core.scheduler.schedule = counting_schedule
    rids = [core.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in reqs]
    cached = {}
    while core.has_work:
        for d in core.step():
            cached[d.rid] = d.num_cached_tokens
    stats = core.cache.stats
    assert stats.num_queried_tokens == sum(map(len, reqs))
    assert stats.num_hit_tokens == sum(cached[r] for r in rids) > 0
    assert stats.num_hit_tokens == core.stats()["cached_tokens"]
    # one match per waiting request per step (no evictions here)
    assert len(calls) <= sum(waiting_per_step)


def test_dfs_weight_puts_cached_prefix_first():
    """At equal age, a request whose prefix is cached goes before one with no hit (SGLang's
    children-first DFS order), and heavier subtrees first."""
    from radixrt.cache.radix import RadixCache
    from radixrt.kv.allocator import BlockAllocator
    from radixrt.scheduler.policy import order_waiting
    from radixrt.scheduler.request import Request

    alloc = BlockAllocator(64)
    cache = RadixCache(alloc, 4)
    for prefix in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]):
        blocks = alloc.allocate(len(prefix) // 4)
        cache.insert(prefix, blocks)
        alloc.decref(blocks)

    def req(rid, toks):
        return Request(rid, len(toks), list(toks), SamplingParams(), 4)

    no_hit = req("none", [50, 51, 52, 53, 54])
    one_a = req("a1", [9, 9, 9, 9, 1, 1])
    two_a = req("b1", [1, 2, 3, 4, 5, 6, 7, 8, 1])
    two_b = req("b2", [1, 2, 3, 4, 5, 6, 7, 8, 2])
    waiting = [no_hit, one_a, two_a, two_b]  # arrival order
    order = order_waiting(waiting, "dfs-weight", lambda r: cache.match(r.seq_token_ids[:-1]), 0)
    assert [r.rid for r in order] == ["b1", "b2", "a1", "none"]
    # aged far past every branch, the no-hit request goes first
    no_hit.waited_steps = 100
    order = order_waiting(waiting, "dfs-weight", lambda r: cache.match(r.seq_token_ids[:-1]), 1.0)
    assert order[0] is no_hit


TORCH_BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == p or name.startswith(p + ".") for p in BLOCKED):
            raise ImportError(f"{name} must not be imported here")
        return None
sys.meta_path.insert(0, Block())
"""


def run_blocked(blocked: list[str], code: str) -> None:
    src = f"BLOCKED = {blocked!r}\n" + TORCH_BLOCKER + textwrap.dedent(code)
    proc = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_scheduler_and_caches_import_no_torch():
    """The scheduler, caches, plan, scripted runner and EngineCore's loop run where torch
    cannot be imported."""
    run_blocked(
        ["torch", "numpy"],
        """
        import radixrt.cache.radix, radixrt.cache.blockhash, radixrt.cache.none
        import radixrt.scheduler.scheduler, radixrt.scheduler.policy, radixrt.plan
        import radixrt.limits, radixrt.testing
        sys.path.insert(0, "tests")
        from test_step_plan import make_core, prompts, run, expected
        from radixrt.sampling import SamplingParams
        core, runner = make_core(overlap=True, num_kv_blocks=14)
        reqs = prompts(6)
        assert run(core, reqs, [SamplingParams(max_tokens=4, ignore_eos=True)] * 6) == expected(
            reqs, [4] * 6
        )
        """,
    )


def test_runner_and_backends_import_no_scheduler():
    run_blocked(
        ["radixrt.scheduler"],
        """
        import radixrt.executor.runner, radixrt.executor.cuda_graph, radixrt.executor.result
        import radixrt.attention.torch_backend, radixrt.attention.flashinfer_backend
        import radixrt.attention.sdpa_backend, radixrt.attention.sdpa_plan
        """,
    )


def test_failed_step_fails_its_requests_only():
    """An exception in a batched step fails that step's requests (FinishReason.ERROR) and
    the engine goes on; a bug in one request's bookkeeping fails that request alone."""
    for overlap in (False, True):
        core, runner = make_core(overlap=overlap)
        execute = runner.execute

        def flaky(plan, execute=execute):
            if any(r.rid == "bad" for r in plan.rows) and plan.step_id == 3:
                raise RuntimeError("kernel exploded")
            return execute(plan)

        runner.execute = flaky
        p = SamplingParams(max_tokens=8, ignore_eos=True)
        core.add_request(prompts(1)[0], p, rid="bad")
        core.add_request(prompts(2)[1], p, rid="good")
        done = {}
        while core.has_work or "late" not in core.scheduler.requests and "late" not in done:
            for d in core.step():
                if d.finished:
                    done[d.rid] = d
            if "bad" in done and "late" not in done and not core.request("late"):
                core.add_request(prompts(3)[2], p, rid="late")  # the engine goes on
        assert done["bad"].finish_reason is FinishReason.ERROR and done["bad"].error
        assert done["good"].finish_reason is FinishReason.ERROR  # same step
        assert done["late"].finish_reason is FinishReason.LENGTH
        assert core.stats()["failed_steps"] == 1
        core.check_integrity()

        core, runner = make_core(overlap=overlap)
        stop_reason = core.scheduler.lifecycle.stop_reason

        def buggy(req, token, stop_reason=stop_reason):
            if req.rid == "bug":
                raise KeyError("oops")
            return stop_reason(req, token)

        core.scheduler.lifecycle.stop_reason = buggy
        out = {}
        core.add_request(prompts(1)[0], p, rid="bug")
        core.add_request(prompts(2)[1], p, rid="fine")
        while core.has_work:
            out |= {d.rid: d for d in core.step() if d.finished}
        assert out["bug"].finish_reason is FinishReason.ERROR
        assert out["fine"].finish_reason is FinishReason.LENGTH
        assert len(out["fine"].new_token_ids) or out["fine"].num_output_tokens == 8
        assert core.stats()["failed_requests"] == 1
        core.check_integrity()


def test_freeze_gc_freezes_startup_objects_until_shutdown():
    import gc

    from radixrt.config import resolve_config

    assert resolve_config("-", "cuda", detect_devices=False).freeze_gc is False  # opt-in
    cfg = EngineConfig(model_path="-", freeze_gc=True)
    runner = ScriptedRunner(cfg.scheduler.max_running_requests, cfg.cache.block_size)
    before = gc.get_freeze_count()
    core = EngineCore(cfg, MODEL, [EOS], runner=runner, num_kv_blocks=16)
    try:
        assert gc.get_freeze_count() > before
        core.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
        while core.has_work:
            core.step()
        core.check_integrity()
    finally:
        core.shutdown()
    assert gc.get_freeze_count() == 0


def test_share_prefix_is_the_common_prefix_bound():
    """share_prefix(a, b, n) is common prefix length >= n, on every cut of random pairs
    that agree up to a random point (the first-probe shortcut changes no answer)."""
    from radixrt.scheduler.policy import share_prefix

    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 80))]
        keep = rng.randrange(0, len(a) + 1)
        b = a[:keep] + [rng.randrange(4) for _ in range(rng.randrange(0, 80))]
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for n in range(-1, 90):
            assert share_prefix(a, b, n) == (common >= n), (a, b, n)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_shared_prefix_in_flight_is_computed_once(overlap):
    """Requests that arrive together and share a long uncached prefix: the first computes
    it, the others wait until its result put the prefix in the tree (with overlap that is
    one step after its last chunk was planned), so every other prompt finds it cached."""
    shared = list(range(100, 164))  # 64 tokens: past IN_BATCH_PREFIX_THRESHOLD
    reqs = [shared + [600 + i, 700 + i] for i in range(6)]
    core, runner = make_core(overlap=overlap, num_kv_blocks=128)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = run(core, reqs, [sp] * len(reqs))
    assert out == expected(reqs, [4] * len(reqs))
    stats = core.scheduler.stats
    # the last prompt token is always recomputed; the shared part is cached for all but one
    assert stats.cached_tokens == (len(reqs) - 1) * len(shared)
    assert runner.overlapped() == overlap
