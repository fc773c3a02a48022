"""The host KV tier on plain Python: the radix tree's two tiers, the scheduler's swap ops, and a
scripted runner that models KV content (so a missing or wrong write-back / load changes the
outputs). Multi-turn and agent-style workloads on a device pool far smaller than the working
set must give the outputs of an unconstrained run, with host hits, and integrity on both pools.
"""

from __future__ import annotations

from collections import Counter

import pytest

from radixrt.cache.radix import RadixCache
from radixrt.cache.radix_host import HostRadixCache
from radixrt.cache.tiers import HostTier
from radixrt.config import CacheConfig, EngineConfig, SchedulerConfig
from radixrt.engine.core import EngineCore
from radixrt.kv.allocator import BlockAllocator
from radixrt.plan import SwapIn, SwapOut
from radixrt.sampling import SamplingParams
from radixrt.testing import ScriptedRunner, scripted_model_config

MODEL = scripted_model_config(4096)
EOS = 3


def ctx_token(rid: str, context) -> int:
    """A token that depends on the whole context read back through the block table."""
    return 10 + hash(tuple(context)) % 3000


def make_core(*, overlap: bool, num_kv_blocks: int, host_blocks: int | None, block_size=4, **s):
    sched = SchedulerConfig(**{"policy": "lpm", **s})
    cache = CacheConfig(block_size=block_size, num_host_kv_blocks=host_blocks)
    cfg = EngineConfig(model_path="-", overlap_schedule=overlap, scheduler=sched, cache=cache)
    runner = ScriptedRunner(sched.max_running_requests, block_size, context_fn=ctx_token)
    core = EngineCore(cfg, MODEL, [EOS], runner=runner, num_kv_blocks=num_kv_blocks)
    return core, runner


def drain(core: EngineCore, out: dict[str, list[int]]) -> None:
    while core.has_work:
        for d in core.step():
            out.setdefault(d.rid, []).extend(d.new_token_ids)
    core.check_integrity()


def multi_turn(core: EngineCore, num_convs=6, turns=4, user=13, answer=5, batch=3) -> dict:
    """Conversations in rounds: each turn's prompt is the history + the last answer + a new
    user message; `batch` conversations run at once, the rest wait (so the device pool
    cannot keep every history)."""
    sp = SamplingParams(max_tokens=answer, ignore_eos=True)
    hist = {c: [1000 + 17 * c + i for i in range(20)] for c in range(num_convs)}
    out: dict[str, list[int]] = {}
    for t in range(turns):
        for lo in range(0, num_convs, batch):
            for c in range(lo, min(lo + batch, num_convs)):
                hist[c] = hist[c] + [2000 + 31 * c + 7 * t + i for i in range(user)]
                core.add_request(hist[c], sp, rid=f"c{c}t{t}")
            drain(core, out)
            for c in range(lo, min(lo + batch, num_convs)):
                hist[c] = hist[c] + out[f"c{c}t{t}"]
    return out


def agent(core: EngineCore, num_agents=4, steps=5) -> dict:
    """A long shared system prompt, per-agent tool outputs appended every step."""
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    system = list(range(100, 160))
    hist = {a: system + [300 + a] for a in range(num_agents)}
    out: dict[str, list[int]] = {}
    for s in range(steps):
        for a in range(num_agents):
            hist[a] = hist[a] + [400 + 10 * a + s] * 6
            core.add_request(hist[a], sp, rid=f"a{a}s{s}")
        drain(core, out)
        for a in range(num_agents):
            hist[a] = hist[a] + out[f"a{a}s{s}"]
    return out


def check_pools(core: EngineCore) -> None:
    """Both pools: free + cached (+ in use, none when idle) == total."""
    cache = core.cache
    assert core.allocator.num_free + cache.cached_blocks == core.allocator.num_blocks
    if cache.host is not None:
        h = cache.host.allocator
        assert h.num_free + cache.host_cached_blocks == h.num_blocks
        assert not cache.host.pending_ops or core.has_work


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("workload", [multi_turn, agent])
def test_host_tier_outputs_match_unconstrained(workload, overlap):
    ref_core, _ = make_core(overlap=overlap, num_kv_blocks=4096, host_blocks=None)
    want = workload(ref_core)
    small, _ = make_core(overlap=overlap, num_kv_blocks=40, host_blocks=None)
    assert workload(small) == want  # recompute path (baseline)
    core, runner = make_core(overlap=overlap, num_kv_blocks=40, host_blocks=400)
    assert workload(core) == want
    check_pools(core)
    s = core.stats()
    assert s["host_hit_tokens"] > 0 and s["host_loaded_blocks"] > 0
    assert s["host_written_back_blocks"] > 0
    assert s["cached_tokens"] > small.stats()["cached_tokens"]
    assert s["prompt_tokens_computed"] < small.stats()["prompt_tokens_computed"]
    ops = Counter(type(op).__name__ for op in runner.swaps)
    assert ops["SwapOut"] == s["host_written_back_blocks"]
    assert ops["SwapIn"] == s["host_loaded_blocks"]


@pytest.mark.parametrize("overlap", [False, True])
def test_small_host_tier_evicts_lru_for_real(overlap):
    ref_core, _ = make_core(overlap=overlap, num_kv_blocks=4096, host_blocks=None)
    want = multi_turn(ref_core, num_convs=8)
    core, _ = make_core(overlap=overlap, num_kv_blocks=40, host_blocks=24)
    assert multi_turn(core, num_convs=8) == want
    check_pools(core)
    s = core.stats()
    assert s["host_evicted_blocks"] > 0 and s["host_hit_tokens"] > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_with_host_tier(overlap):
    """A pool so small that decode rows preempt: still the unconstrained outputs."""
    ref_core, _ = make_core(overlap=overlap, num_kv_blocks=4096, host_blocks=None)
    want = multi_turn(ref_core, batch=6, answer=12)
    core, _ = make_core(overlap=overlap, num_kv_blocks=34, host_blocks=300)
    assert multi_turn(core, batch=6, answer=12) == want
    check_pools(core)
    assert core.stats()["preemptions"] > 0 and core.stats()["host_hit_tokens"] > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_with_host_tier(overlap):
    ref_core, _ = make_core(overlap=overlap, num_kv_blocks=4096, host_blocks=None)
    want = agent(ref_core)
    core, _ = make_core(
        overlap=overlap, num_kv_blocks=40, host_blocks=300, max_num_batched_tokens=16
    )
    assert agent(core) == want
    check_pools(core)


def test_abort_during_swap_in():
    """Abort a request while the step loading its history is in flight (overlap holds it):
    nothing leaks, the loaded node keeps valid KV, a later request reuses it correctly."""
    ref_core, _ = make_core(overlap=True, num_kv_blocks=4096, host_blocks=None)
    core, runner = make_core(overlap=True, num_kv_blocks=40, host_blocks=400)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    first = list(range(500, 560))
    for c in (ref_core, core):
        c.add_request(first, sp, rid="warm")
        drain(c, {})
    # push `first` to the host: other prompts fill the device
    for i in range(3):
        core.add_request([700 + 50 * i + j for j in range(40)], sp, rid=f"fill{i}")
        drain(core, {})
    assert core.cache.match(first).num_host_tokens > 0
    core.add_request(first + [9, 9], sp, rid="victim")
    core.step()  # launches the plan with the swap-ins; its result is still due
    assert any(isinstance(op, SwapIn) for op in runner.swaps)
    assert core.scheduler.num_inflight_steps == 1
    core.abort("victim")
    drain(core, {})
    check_pools(core)
    out_ref, out = {}, {}
    ref_core.add_request(first + [5], sp, rid="after")
    drain(ref_core, out_ref)
    core.add_request(first + [5], sp, rid="after")
    drain(core, out)
    assert out["after"] == out_ref["after"]
    check_pools(core)


def test_host_tier_config_errors():
    with pytest.raises(ValueError, match="host_kv_gb"):
        CacheConfig(host_kv_gb=-1)
    with pytest.raises(ValueError, match="radix"):
        CacheConfig(prefix_cache="blockhash", host_kv_gb=1)
    with pytest.raises(ValueError, match="radix"):
        CacheConfig(prefix_cache="none", num_host_kv_blocks=8)
    with pytest.raises(ValueError, match="num_host_kv_blocks"):
        CacheConfig(num_host_kv_blocks=0)
    assert not CacheConfig().host_tier and CacheConfig(host_kv_gb=0.5).host_tier


# ---- the tree alone ----


def tree(num_blocks=8, host_blocks=8, bs=4):
    alloc = BlockAllocator(num_blocks)
    return HostRadixCache(alloc, bs, HostTier(host_blocks)), alloc


def put(cache: RadixCache, tokens: list[int]) -> None:
    blocks = cache.allocator.allocate(-(-len(tokens) // cache.block_size))
    cache.insert(tokens, blocks)
    cache.allocator.decref(blocks)


def test_tree_write_back_match_load_and_split():
    cache, alloc = tree()
    put(cache, list(range(10)))  # 3 blocks
    put(cache, list(range(6)) + [50, 51])  # branch inside block 1: 1 new block
    cache.check_integrity()
    assert cache.evict(4) == 4  # both leaves and then their parent go to the host
    ops = cache.take_swap_ops()
    # the parent shares a child's copy of block 1 (the edges end inside it): 4 blocks, not 5
    assert all(isinstance(op, SwapOut) for op in ops) and len(ops) == 4
    assert cache.cached_blocks == 0 and cache.host_cached_blocks == 4
    cache.check_integrity()
    m = cache.match(list(range(9)) + [77])  # ends inside a host-only edge: splits it
    assert m.num_cached_tokens == 9 and m.num_host_tokens == 9 and m.blocks == []
    cache.check_integrity()
    cache.lock(m.handle)
    table = cache.load(m.handle)
    assert len(table) == 3
    loads = cache.take_swap_ops()
    assert [type(op) for op in loads] == [SwapIn] * 3  # block 1 once, for both nodes
    cache.check_integrity()
    assert cache.match(list(range(9))).num_host_tokens == 0
    cache.unlock(m.handle)
    cache.check_integrity()
    # evicting a node with a host copy writes nothing back
    cache.evict(8)
    assert not any(isinstance(op, SwapOut) for op in cache.take_swap_ops())
    cache.check_integrity()
    cache.reset()
    cache.check_integrity()
    assert cache.total_tokens == 0 and alloc.num_free == 8 and cache.host.allocator.num_free == 8


def test_tree_full_host_drops_subtree():
    cache, alloc = tree(num_blocks=6, host_blocks=2)
    put(cache, list(range(8)))  # 2 blocks
    cache.evict(2)  # written back: the host is full now
    put(cache, list(range(100, 112)))  # 3 blocks
    cache.lock(cache.match(list(range(8))).handle)  # a locked host-only node is never evicted
    cache.evict(3)  # the host can make no room: dropped
    assert cache.host.stats.num_dropped_blocks == 3
    assert cache.match(list(range(100, 112))).num_cached_tokens == 0
    cache.check_integrity()


def test_insert_over_host_only_node_takes_callers_blocks():
    cache, alloc = tree()
    put(cache, list(range(8)))
    cache.evict(2)
    cache.take_swap_ops()
    blocks = alloc.allocate(3)
    res = cache.insert(list(range(12)), blocks)  # the caller computed the same tokens
    alloc.decref(blocks)
    cache.check_integrity()
    m = cache.match(list(range(12)))
    assert m.num_host_tokens == 0 and m.blocks == blocks
    assert res.num_new_tokens == 4


def test_host_tier_scheduler_imports_no_torch():
    """The host tier's scheduler side (tree tiers, host allocator, swap ops) is plain Python."""
    from test_step_plan import run_blocked

    run_blocked(
        ["torch", "numpy"],
        """
        import radixrt.cache.tiers
        sys.path.insert(0, "tests")
        import test_host_tier_scheduler as t
        ref, _ = t.make_core(overlap=True, num_kv_blocks=4096, host_blocks=None)
        core, _ = t.make_core(overlap=True, num_kv_blocks=40, host_blocks=400)
        assert t.multi_turn(core) == t.multi_turn(ref)
        assert core.stats()["host_hit_tokens"] > 0
        """,
    )


def test_host_tier_with_draft_model_is_refused():
    from radixrt.config import resolve_config

    with pytest.raises(ValueError, match="host KV tier.*draft"):
        resolve_config(
            "-", "cpu", detect_devices=False, host_kv_gb=1.0,
            speculative_method="draft", speculative_draft_model="/nonexistent",
            num_speculative_tokens=2,
        )  # fmt: skip
