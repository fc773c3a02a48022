"""Cache salts (tenants) and priorities on plain Python: the radix tree and the block-hash cache
keyed by salt, the scheduler with a scripted runner (no KV shared across salts on either tier,
in-batch dedup and radix drafts per salt), priority order with aging, and the server's tenants.
"""

from __future__ import annotations

import pytest
from radix_helpers import namespace_of

from radixrt.cache import CacheNamespace
from radixrt.cache.blockhash import BlockHashCache
from radixrt.cache.radix import RadixCache
from radixrt.config import CacheConfig, EngineConfig, SchedulerConfig
from radixrt.engine.core import EngineCore
from radixrt.kv.allocator import BlockAllocator
from radixrt.sampling import (
    DEFAULT_OPTIONS,
    MAX_CACHE_SALT_CHARS,
    MAX_PRIORITY,
    MIN_PRIORITY,
    RequestOptions,
    SamplingParams,
)
from radixrt.scheduler.policy import order_waiting
from radixrt.scheduler.request import Request
from radixrt.tenant import Tenant
from radixrt.testing import ScriptedRunner, scripted_model_config

MODEL = scripted_model_config(4096)
EOS = 3
PROMPT = list(range(100, 160))
A, B = CacheNamespace("a"), CacheNamespace("b")  # two tenants' cache namespaces

HOLD_30 = RequestOptions(cache_ttl_s=30)  # a retention hint of 30 s


def ctx_token(rid: str, context) -> int:
    return 10 + hash(tuple(context)) % 3000


def make_core(num_kv_blocks=256, host_blocks=None, policy="lpm", **s):
    sched = SchedulerConfig(policy=policy, **s)
    cache = CacheConfig(block_size=4, num_host_kv_blocks=host_blocks)
    cfg = EngineConfig(model_path="-", overlap_schedule=False, scheduler=sched, cache=cache)
    runner = ScriptedRunner(sched.max_running_requests, 4, context_fn=ctx_token)
    return EngineCore(cfg, MODEL, [EOS], runner=runner, num_kv_blocks=num_kv_blocks)


def run(core: EngineCore, on_step=None) -> dict:
    """Step until idle; returns rid -> cached prompt tokens reported."""
    cached = {}
    while core.has_work:
        for d in core.step():
            cached.setdefault(d.rid, d.num_cached_tokens)
        if on_step is not None:
            on_step(core)
    core.check_integrity()
    return cached


# ---- the caches ----
def test_radix_salts_are_separate_trees():
    cache = RadixCache(BlockAllocator(64), 4)
    blocks = cache.allocator.allocate(3)
    cache.insert(PROMPT[:10], blocks, A)
    cache.allocator.decref(blocks)
    assert cache.match(PROMPT[:10], A).num_cached_tokens == 10
    assert cache.match(PROMPT[:10], B).num_cached_tokens == 0
    assert cache.match(PROMPT[:10]).num_cached_tokens == 0
    assert cache.peek_continuation(PROMPT[:4], 4, A) == PROMPT[4:8]
    assert cache.peek_continuation(PROMPT[:4], 4, B) == []
    assert cache.peek_continuation(PROMPT[:4], 4) == []
    assert namespace_of(cache, cache.match(PROMPT[:6], A).handle) == A
    cache.check_integrity()
    # the same tokens under another salt get their own blocks
    other = cache.allocator.allocate(3)
    result = cache.insert(PROMPT[:10], other, B)
    cache.allocator.decref(other)
    assert result.num_new_tokens == 10
    assert set(cache.match(PROMPT[:10], A).blocks).isdisjoint(cache.match(PROMPT[:10], B).blocks)
    cache.check_integrity()
    # a salt's root goes when its last entry does (no memory per forgotten salt)
    cache.reset()
    assert cache.roots == [cache.root] and cache.allocator.num_free == 64
    cache.check_integrity()


def test_blockhash_flush_salts_drops_only_those_salts_unlocked_blocks():
    """The block-hash cache records each block's salt at insert (its hash hides it): a
    tenant's flush frees that tenant's unlocked blocks and keeps a locked one and others'."""
    cache = BlockHashCache(BlockAllocator(64), 4)
    for salt in ("t:a:1", "t:b:1", None):
        blocks = cache.allocator.allocate(3)
        cache.insert(PROMPT[:12], blocks, CacheNamespace(salt))
        cache.allocator.decref(blocks)
    blocks = cache.allocator.allocate(3)
    locked = cache.insert(PROMPT[20:32], blocks, CacheNamespace("t:a:1"))
    cache.allocator.decref(blocks)
    cache.lock(locked.handle)
    free = cache.allocator.num_free
    freed = cache.flush_salts(lambda s: s is not None and s.startswith("t:a:"))
    assert freed == 3 and cache.allocator.num_free == free + 3
    assert cache.match(PROMPT[:12], CacheNamespace("t:a:1")).num_cached_tokens == 0
    assert cache.match(PROMPT[20:32], CacheNamespace("t:a:1")).num_cached_tokens == 12
    for salt in ("t:b:1", None):
        assert cache.match(PROMPT[:12], CacheNamespace(salt)).num_cached_tokens == 12
    cache.check_integrity()
    cache.unlock(locked.handle)
    cache.check_integrity()


def test_radix_flush_salts_drops_only_those_salts_unlocked_entries():
    """A tenant's flush (`flush_salts`) frees its salts' unlocked entries, keeps a locked
    path and every other salt's entries, and drops the salt roots it empties."""
    cache = RadixCache(BlockAllocator(64), 4)
    for salt in ("t:a:1", "t:a:2", "t:b:1", None):
        blocks = cache.allocator.allocate(3)
        cache.insert(PROMPT[:10], blocks, CacheNamespace(salt))
        cache.allocator.decref(blocks)
        blocks = cache.allocator.allocate(3)
        cache.insert(PROMPT[:6] + [7, 7, 7, 7], blocks, CacheNamespace(salt))  # two leaves
        cache.allocator.decref(blocks)
    locked = cache.match(PROMPT[:10], CacheNamespace("t:a:2"))
    cache.lock(locked.handle)
    free = cache.allocator.num_free
    freed = cache.flush_salts(lambda s: s is not None and s.startswith("t:a:"))
    assert freed == cache.allocator.num_free - free > 0
    assert cache.match(PROMPT[:10], CacheNamespace("t:a:1")).num_cached_tokens == 0
    assert cache.match(PROMPT[:10], CacheNamespace("t:a:2")).num_cached_tokens == 10  # locked
    assert cache.match(PROMPT[:6] + [7, 7, 7, 7], CacheNamespace("t:a:2")).num_cached_tokens == 6
    for salt in ("t:b:1", None):
        assert cache.match(PROMPT[:10], CacheNamespace(salt)).num_cached_tokens == 10
    assert CacheNamespace("t:a:1") not in cache._roots
    cache.check_integrity()
    cache.unlock(locked.handle)
    cache.check_integrity()


def test_radix_salted_lock_and_evict():
    cache = RadixCache(BlockAllocator(8), 4)
    for salt, base in ((A, 0), (B, 1)):
        blocks = cache.allocator.allocate(2)
        cache.insert([base] * 8, blocks, salt)
        cache.allocator.decref(blocks)
    m = cache.match([0] * 8, A)
    cache.lock(m.handle)
    assert cache.evictable_blocks == 2
    assert cache.evict(4) == 2  # only b's entry goes: a's is locked
    assert cache.match([1] * 8, B).num_cached_tokens == 0
    cache.unlock(m.handle)
    cache.check_integrity()


def test_blockhash_salt_seeds_the_chain():
    cache = BlockHashCache(BlockAllocator(16), 4)
    blocks = cache.allocator.allocate(2)
    cache.insert(PROMPT[:8], blocks, A)
    cache.allocator.decref(blocks)
    assert cache.match(PROMPT[:8], A).num_cached_tokens == 8
    assert cache.match(PROMPT[:8], B).num_cached_tokens == 0
    assert cache.match(PROMPT[:8]).num_cached_tokens == 0
    assert set(cache.block_hashes(PROMPT[:8], A)).isdisjoint(cache.block_hashes(PROMPT[:8]))
    cache.check_integrity()


# ---- the scheduler ----
@pytest.mark.parametrize("prefix_cache", ["radix", "blockhash"])
def test_tenants_share_no_kv_and_compute_every_prompt_token(prefix_cache):
    sched = SchedulerConfig(policy="lpm")
    cfg = EngineConfig(
        model_path="-",
        overlap_schedule=False,
        scheduler=sched,
        cache=CacheConfig(block_size=4, prefix_cache=prefix_cache),
    )
    core = EngineCore(
        cfg, MODEL, [EOS], runner=ScriptedRunner(256, 4, context_fn=ctx_token), num_kv_blocks=256
    )
    tables: dict[str, set[int]] = {"a": set(), "b": set()}

    def record(core):
        for req in core.scheduler.queues.running:
            tables[req.cache_salt].update(req.block_table)

    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    salt = {s: RequestOptions(cache_salt=s) for s in "ab"}
    core.add_request(PROMPT, sp, rid="a0", options=salt["a"])
    run(core, record)
    before = core.scheduler.stats.prompt_tokens_computed
    # b sends a's prompt while a sends it again: b's is computed in full, a's is not
    core.add_request(PROMPT, sp, rid="b0", options=salt["b"])
    core.add_request(PROMPT + [7], sp, rid="a1", options=salt["a"])
    cached = run(core, record)
    assert cached["b0"] == 0
    assert cached["a1"] >= 56  # the same salt shares as before
    computed = core.scheduler.stats.prompt_tokens_computed - before
    assert len(PROMPT) <= computed <= len(PROMPT) + 5
    assert tables["a"].isdisjoint(tables["b"])


def test_tenants_get_no_host_tier_hits():
    core = make_core(num_kv_blocks=24, host_blocks=128)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    salt = {s: RequestOptions(cache_salt=s) for s in "ab"}
    prompts = [[1000 + 50 * i + j for j in range(40)] for i in range(4)]
    for i, p in enumerate(prompts):  # a's prompts overflow the device pool to the host
        core.add_request(p, sp, rid=f"a{i}", options=salt["a"])
        run(core)
    assert core.cache.host_cached_blocks > 0
    stats = core.scheduler.stats
    for i, p in enumerate(prompts):
        core.add_request(p, sp, rid=f"b{i}", options=salt["b"])
        assert run(core)[f"b{i}"] == 0
    assert stats.host_hit_tokens == 0
    core.add_request(prompts[0], sp, rid="again", options=salt["a"])  # control: a's own host hits
    assert run(core)["again"] > 0 and stats.host_hit_tokens > 0


def test_in_batch_dedup_holds_back_only_the_same_salt():
    core = make_core(max_num_batched_tokens=64, long_prefill_token_threshold=16)
    long = list(range(200, 264))
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    salt = {s: RequestOptions(cache_salt=s) for s in "ab"}
    core.add_request(long, sp, rid="a0", options=salt["a"])
    core.step()  # a0 computes its first chunk: its prefix is not cached yet
    core.add_request(long + [1], sp, rid="b0", options=salt["b"])
    core.add_request(long + [2], sp, rid="a1", options=salt["a"])
    core.step()
    running = {r.rid for r in core.scheduler.queues.running}
    assert "b0" in running and "a1" not in running  # a1 waits for a0's prefix
    cached = run(core)
    assert cached["a1"] >= 32 and cached["b0"] == 0


def test_without_a_prefix_cache_nothing_is_held_back():
    """lpm with no prefix cache: waiting for another request's prefix would gain nothing (it
    is never cached), so a request sharing it is admitted at once."""
    sched = SchedulerConfig(
        policy="lpm", max_num_batched_tokens=64, long_prefill_token_threshold=16
    )
    cache = CacheConfig(block_size=4, prefix_cache="none")
    cfg = EngineConfig(model_path="-", overlap_schedule=False, scheduler=sched, cache=cache)
    runner = ScriptedRunner(sched.max_running_requests, 4, context_fn=ctx_token)
    core = EngineCore(cfg, MODEL, [EOS], runner=runner, num_kv_blocks=256)
    long = list(range(200, 264))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    core.add_request(long, params, rid="a0")
    core.step()
    core.add_request(long + [2], params, rid="a1")
    core.step()
    assert "a1" in {r.rid for r in core.scheduler.queues.running}
    run(core)
    core.check_integrity()


def test_radix_drafts_read_only_their_salt():
    from radixrt.speculative.radix import RadixProposer

    cache = RadixCache(BlockAllocator(64), 4)
    blocks = cache.allocator.allocate(4)
    cache.insert(PROMPT[:16], blocks, A)
    proposer = RadixProposer(cache)
    assert proposer.propose(PROMPT[:8], 4, A) == PROMPT[8:12]
    assert proposer.propose(PROMPT[:8], 4, B) == []


def test_dfs_weight_orders_requests_of_several_salts():
    cache = RadixCache(BlockAllocator(64), 4)
    for salt in (A, B):
        blocks = cache.allocator.allocate(4)
        cache.insert(PROMPT[:16], blocks, salt)
    salt = {s: RequestOptions(cache_salt=s) for s in ("a", "b", "c")}
    waiting = [
        Request(f"r{i}", 20, PROMPT[:16] + [i] * 4, SamplingParams(), 4, options=salt["abcb"[i]])
        for i in range(4)
    ]
    order = order_waiting(
        waiting, "dfs-weight", lambda r: cache.match(r.seq_token_ids[:-1], r.cache_namespace), 0
    )
    assert sorted(r.rid for r in order) == ["r0", "r1", "r2", "r3"]
    assert [r.rid for r in order][:2] == ["r1", "r3"]  # b's subtree is the heaviest


# ---- priority ----
def test_priority_orders_admission_then_ages():
    waiting = [
        Request(f"r{i}", 4, [i] * 4, SamplingParams(), 4, options=RequestOptions(priority=p))
        for i, p in enumerate([5, 0, -1, 0])
    ]
    cache = RadixCache(BlockAllocator(4), 4)
    match = lambda r: cache.match(r.seq_token_ids)
    for policy in ("fcfs", "lpm", "dfs-weight"):
        order = order_waiting(waiting, policy, match, 4.0, 10)
        assert [r.rid for r in order] == ["r2", "r1", "r3", "r0"], policy
    waiting[0].waited_steps = 60  # 5 - 60 // 10 = -1: level with r2, earlier in the queue
    assert [r.rid for r in order_waiting(waiting, "fcfs", match, 4.0, 10)][:2] == ["r0", "r2"]
    assert [r.rid for r in order_waiting(waiting, "fcfs", match, 4.0, 0)][0] == "r2"
    # the overdue go first, in queue order, whatever their priority
    late = lambda r: r.rid in ("r3", "r0")
    assert [r.rid for r in order_waiting(waiting, "lpm", match, 4.0, 0, late)] == [
        "r0", "r3", "r2", "r1"
    ]  # fmt: skip


@pytest.mark.parametrize("max_wait_s", [10.0, 0.0])
def test_a_request_of_the_lowest_priority_starts_within_the_wait_bound(max_wait_s):
    """A flood at the most urgent priority keeps the slots busy and the queue full; a request
    at the least urgent one starts once it waited `priority_max_wait_s` (aging by steps would
    take (gap * priority_aging_steps) steps), and without the bound it is still waiting."""
    clock = FakeClock()
    sched = SchedulerConfig(policy="lpm", max_running_requests=2, priority_max_wait_s=max_wait_s)
    cfg = EngineConfig(model_path="-", overlap_schedule=False, scheduler=sched)
    runner = ScriptedRunner(2, 16)
    core = EngineCore(cfg, MODEL, [EOS], runner=runner, num_kv_blocks=64, clock=clock)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    core.add_request([900] * 20, sp, "low", options=RequestOptions(priority=10))
    low = core.scheduler.queues.requests["low"]
    started_at, n = None, 0
    while clock.now < 60 and started_at is None:
        while len(core.scheduler.queues.waiting) < 6:  # the flood never lets up
            n += 1
            core.add_request([1000 + n] * 20, sp, f"f{n}", options=RequestOptions(priority=-10))
        core.step()
        if low.num_computed > 0:
            started_at = clock.now
        clock.now += 0.05
    if max_wait_s:
        assert started_at is not None and started_at <= max_wait_s + 1, started_at
    else:
        assert started_at is None  # a 20-level gap ages away only after 5,120 steps
    core.check_integrity()


def test_priority_admits_first_and_preempts_last():
    core = make_core(policy="fcfs", max_running_requests=1)
    for i, p in enumerate([3, 1, 2, -4]):
        options = RequestOptions(priority=p)
        core.add_request(
            [500 + i] * 8, SamplingParams(max_tokens=2, ignore_eos=True), f"r{i}", options=options
        )
    finished = []
    while core.has_work:
        finished += [d.rid for d in core.step() if d.finish_reason is not None]
    assert finished == ["r3", "r1", "r2", "r0"]
    # a pool too small for both: the lower priority (higher number) goes, though older
    core = make_core(policy="fcfs", num_kv_blocks=8)
    long = SamplingParams(max_tokens=12, ignore_eos=True)
    core.add_request([600] * 8, long, "lo", options=RequestOptions(priority=1))
    core.step()
    core.add_request([700] * 8, long, "hi", options=RequestOptions(priority=-1))
    seen: dict[str, Request] = {}

    def record(core):
        for r in [*core.scheduler.queues.running, *core.scheduler.queues.waiting]:
            seen[r.rid] = r

    run(core, record)
    assert seen["lo"].num_preemptions >= 1 and seen["hi"].num_preemptions == 0


def test_priority_and_salt_are_validated():
    for bad in (MIN_PRIORITY - 1, MAX_PRIORITY + 1, 1.5):
        with pytest.raises(ValueError, match="priority"):
            RequestOptions(priority=bad)
    with pytest.raises(ValueError, match="cache_salt"):
        RequestOptions(cache_salt="")
    RequestOptions(priority=MIN_PRIORITY, cache_salt="x")
    with pytest.raises(TypeError):  # sampling holds sampling only
        SamplingParams(cache_salt="x")


def test_dsl_gen_takes_cache_salt_and_priority():
    from radixrt.frontend.ir import gen
    from radixrt.frontend.program import _gen_defaults

    options = gen("x", cache_salt="t", priority=-2).params.options(None)
    assert (options.cache_salt, options.priority) == ("t", -2)
    defaults = _gen_defaults({"cache_salt": "prog"})
    assert gen("y").params.options(defaults).cache_salt == "prog"
    with pytest.raises(ValueError, match="cache_salt"):
        gen("z", cache_salt="")


def test_eviction_takes_lower_priority_entries_first():
    cache = RadixCache(BlockAllocator(8), 4)
    for base, priority in ((0, 0), (1, 5), (2, 0)):  # the priority-5 entry is not the LRU
        blocks = cache.allocator.allocate(2)
        cache.insert([base] * 8, blocks, priority=priority)
        cache.allocator.decref(blocks)
    cache.check_integrity()
    assert cache.evict(2) == 2
    assert cache.match([1] * 8).num_cached_tokens == 0
    assert cache.match([0] * 8).num_cached_tokens == 8
    # re-inserted by a more urgent request, an entry takes its priority
    blocks = cache.allocator.allocate(2)
    cache.insert([0] * 8, blocks, priority=7)
    cache.allocator.decref(blocks)
    assert cache.evict(2) == 2
    assert cache.match([0] * 8).num_cached_tokens == 0
    assert cache.match([2] * 8).num_cached_tokens == 8
    cache.check_integrity()


def test_finished_low_priority_requests_lose_their_cache_first():
    core = make_core(num_kv_blocks=24)
    for rid, base, p in (("hi", 800, -1), ("lo", 900, 3)):
        core.add_request(
            [base + i for i in range(40)],
            SamplingParams(max_tokens=1, ignore_eos=True),
            rid=rid,
            options=RequestOptions(priority=p),
        )
        run(core)
    core.add_request([700 + i for i in range(40)], SamplingParams(max_tokens=1), rid="new")
    run(core)  # needs blocks: evicts lo's prefix, not the older hi's
    hit = {}
    for rid, base in (("hi2", 800), ("lo2", 900)):
        core.add_request([base + i for i in range(40)], SamplingParams(max_tokens=1), rid=rid)
        hit.update(run(core))
    assert hit["hi2"] >= 36


# ---- retention hints ----
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def retention_core(**s):
    core = make_core(num_kv_blocks=40, **s)
    clock = core.scheduler.retention.clock = FakeClock()
    return core, clock


def fill(core, base, n=3):
    """`n` unrelated prompts of 40 tokens (10 blocks each): evicts what is not held."""
    for i in range(n):
        core.add_request([base + 50 * i + j for j in range(40)], SamplingParams(max_tokens=1))
        run(core)


def test_retention_keeps_a_prompt_through_pressure_then_expires():
    core, clock = retention_core(retention_max_share=0.5)
    agent = [400 + j for j in range(40)]
    core.add_request(agent, SamplingParams(max_tokens=1), rid="step0", options=HOLD_30)
    run(core)
    retention = core.scheduler.retention
    assert retention.num_held_blocks == 10
    fill(core, 1000)
    core.add_request(agent + [1], SamplingParams(max_tokens=1), rid="step1")
    assert run(core)["step1"] >= 36  # kept under pressure
    clock.now = 31
    core.step()  # the hold expires
    assert retention.num_held_blocks == 0 and core.scheduler.stats.retention_expired == 1
    fill(core, 2000, n=4)
    core.add_request(agent + [1], SamplingParams(max_tokens=1), rid="step2")
    assert run(core)["step2"] < 36  # plain LRU again
    core.check_integrity()


def test_retention_is_bounded_and_released_early_or_when_short():
    core, clock = retention_core(retention_max_share=0.25, retention_max_ttl_s=5)
    retention = core.scheduler.retention
    for i in range(3):  # 10 blocks each, at most 10 held: the oldest lineage keeps its hold,
        # the younger ones are refused
        core.add_request(
            [3000 + 50 * i + j for j in range(40)],
            SamplingParams(max_tokens=1),
            rid=f"h{i}",
            options=RequestOptions(cache_ttl_s=1000),
        )
        run(core)
        assert retention.num_held_blocks <= 10
    assert list(retention.holds) == ["h0"] and core.scheduler.stats.retention_refused == 2
    assert retention.holds["h0"].expires == 5  # capped by retention_max_ttl_s
    assert retention.release("h0") and not retention.release("h0")
    assert not core.release_cache_hold("h0")
    core.add_request(
        [2900] * 40, SamplingParams(max_tokens=1), rid="h3", options=RequestOptions(cache_ttl_s=9)
    )
    run(core)
    core.add_request(
        [2901] * 40, SamplingParams(max_tokens=1), rid="h4", options=RequestOptions(cache_ttl_s=9)
    )
    run(core)
    assert list(retention.holds) == ["h3"]  # the share bound: one 10-block hold
    core.flush_cache()  # a flush ends the holds too
    assert not retention.holds and core.cache.cached_blocks == 0
    core.add_request(
        [2900] * 40, SamplingParams(max_tokens=1), rid="h3", options=RequestOptions(cache_ttl_s=9)
    )
    run(core)
    # a request that needs the whole pool gets it: the hold is given up, not a deadlock
    core.add_request([3600 + j for j in range(150)], SamplingParams(max_tokens=2), rid="big")
    run(core)
    assert not retention.holds
    core.check_integrity()


def test_retention_hold_goes_to_the_host_tier():
    core = make_core(num_kv_blocks=40, host_blocks=200, retention_max_share=0.5)
    agent = [400 + j for j in range(40)]
    core.add_request(agent, SamplingParams(max_tokens=1), rid="a", options=HOLD_30)
    run(core)
    core.add_request([3600 + j for j in range(150)], SamplingParams(max_tokens=2), rid="big")
    run(core)  # needs the whole pool: the hold is released and written back, not dropped
    core.add_request(agent + [1], SamplingParams(max_tokens=1), rid="again")
    assert run(core)["again"] >= 36 and core.scheduler.stats.host_hit_tokens > 0


@pytest.mark.parametrize("host_blocks", [None, 96])
def test_salted_mixed_load_matches_an_unconstrained_run(host_blocks):
    """Agents of three salts and none, sharing a system prompt, with priorities and retention
    hints, on a pool far smaller than their working set: every output equals that of a run
    with a large pool and no salts (the scripted runner reads the KV back, so a block shared
    or loaded wrongly changes the output), and integrity holds on both tiers."""
    system = list(range(100, 160))

    def workload(core, salted):
        out: dict[str, list[int]] = {}
        hist = {a: system + [300 + a] for a in range(8)}
        for step in range(4):
            for a in range(8):
                salt = ("abc"[a % 3] if a % 4 else None) if salted else None
                sp = SamplingParams(max_tokens=4, ignore_eos=True)
                options = RequestOptions(
                    cache_salt=salt,
                    priority=a % 3 - 1 if salted else 0,
                    cache_ttl_s=10 if salted else 0,
                )
                core.add_request(hist[a], sp, rid=f"a{a}s{step}", options=options)
            while core.has_work:
                for d in core.step():
                    out.setdefault(d.rid, []).extend(d.new_token_ids)
            core.check_integrity()
            for a in range(8):
                hist[a] = hist[a] + out[f"a{a}s{step}"] + [500 + 7 * a + step] * 5
        return out

    reference = workload(make_core(num_kv_blocks=1024), salted=False)
    core = make_core(
        num_kv_blocks=60,
        host_blocks=host_blocks,
        max_num_batched_tokens=64,
        retention_max_share=0.3,
    )
    assert workload(core, salted=True) == reference
    assert core.scheduler.stats.preemptions + core.cache.stats.num_evicted_blocks > 0


def test_dsl_program_salt_covers_gens_selects_and_prefills():
    from radixrt.frontend import Backend, GenResult, function, gen, select

    class Tok:
        bos_token = None

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    class Recorder(Backend):
        tokenizer = Tok()

        def __init__(self):
            self.salts = []
            self.released = []

        def generate(self, prompt_ids, params, on_delta=None, options=DEFAULT_OPTIONS):
            self.salts.append(("gen" if params.max_tokens else "prefill", options.cache_salt))
            rid = f"r{len(self.salts)}"
            return GenResult("ok", [1], "length", len(prompt_ids), 1, 0, rid=rid)

        def release_cache_holds(self, rids):
            self.released += rids

        def score_continuations(self, prefix_ids, continuations, cache_salt=None):
            self.salts.append(("score", cache_salt))
            return [[-1.0] * len(c) for c in continuations]

    @function
    def prog(s):
        s += "Q:" + gen("a", max_tokens=1)
        s += select("b", ["x", "yy"])
        forks = s.fork(2)
        for f in forks:
            f += gen("c", max_tokens=1)
        forks.join()

    backend = Recorder()
    prog.run(backend=backend, gen_defaults={"cache_salt": "tenant-1"})
    assert backend.salts and all(salt == "tenant-1" for _, salt in backend.salts)
    assert {kind for kind, _ in backend.salts} == {"gen", "score", "prefill"}
    assert backend.released == []  # no retention hint, nothing held
    # a program's retention hint holds its contexts (gens, and the prefixes it sends ahead
    # for the select and the fork) while it runs: released at its end
    backend = Recorder()
    prog.run(backend=backend, gen_defaults={"cache_ttl_s": 60})
    sent = [f"r{i + 1}" for i, (kind, _) in enumerate(backend.salts) if kind != "score"]
    assert sorted(backend.released) == sorted(sent) and len(sent) == 5


def test_held_blocks_count_every_block_a_hold_keeps_once():
    """Two holds diverging inside a block: the second copies the shared partial block, so its
    path keeps the parent's copy of that block and its own (a match's table shows only its
    own); a block both holds keep counts once."""
    core, _ = retention_core(retention_max_share=1.0)
    retention = core.scheduler.retention
    shared = [700 + j for j in range(10)]  # 2 full blocks of 4 and 2 tokens of the third
    for rid, tail in (("a", [20, 21]), ("b", [30, 31])):
        core.add_request(shared + tail, SamplingParams(max_tokens=1), rid=rid, options=HOLD_30)
    run(core)
    a, b = retention.holds["a"], retention.holds["b"]
    assert len(a.blocks) == 3 and len(b.blocks) == 4  # b: its copy of block 2 and a's
    assert len(set(a.blocks) & set(b.blocks)) == 3
    assert retention.num_held_blocks == 4 == core.stats()["retention_held_blocks"]
    retention.release("a")
    assert retention.num_held_blocks == 4  # b's path keeps all four
    retention.release("b")
    assert retention.num_held_blocks == 0
    core.check_integrity()


def test_retention_lineages_keep_the_oldest_and_give_way_youngest_first():
    """At the share bound (20 of 40 blocks) an agent's next hold inherits its first hold's
    age: it ends a younger agent's hold for room, and a new agent that does not fit is
    refused rather than ending an older one."""
    core, _ = retention_core(retention_max_share=0.5)
    retention, stats = core.scheduler.retention, core.scheduler.stats
    x = [800 + j for j in range(39)]  # 40 tokens with the output: 10 blocks
    y = [900 + j for j in range(31)]  # 8 blocks
    hold = SamplingParams(max_tokens=1, ignore_eos=True)
    core.add_request(x, hold, rid="x0", options=HOLD_30)
    run(core)
    core.add_request(y, hold, rid="y0", options=HOLD_30)
    run(core)
    assert set(retention.holds) == {"x0", "y0"} and retention.num_held_blocks == 18
    x_seq = x + [retention.holds["x0"].tokens[-1]]
    core.add_request(x_seq + [5] * 15, hold, rid="x1", options=HOLD_30)  # 56 tokens: 14 blocks
    run(core)
    assert set(retention.holds) == {"x1"}  # x0 covered, y0 (younger) given up for room
    assert retention.holds["x1"].born == 0 and stats.retention_released == 1
    core.add_request(
        [950 + j for j in range(31)], hold, rid="z0", options=HOLD_30
    )  # 8 blocks: no room
    run(core)
    assert set(retention.holds) == {"x1"} and stats.retention_refused == 1
    core.check_integrity()


def test_retention_bounds_each_tenant_over_all_its_salts():
    """A tenant's holds stay within its share however many cache salts it uses (a bound per
    salt let one tenant hold the pool with many salts), the holds of another tenant are not
    given up for it, a tenant's own `retention_share` overrides the default, and requests
    without a tenant are bounded by the pool's share only (as before tenants)."""
    core = make_core(num_kv_blocks=80, retention_max_share=0.8, retention_max_tenant_share=0.25)
    retention = core.scheduler.retention
    a, b, c = Tenant("a"), Tenant("b"), Tenant("c", retention_share=0.5)

    def hold(tenant, base, n, salt_prefix):
        for i in range(n):  # 40 tokens with the output: 10 blocks each
            sp = SamplingParams(max_tokens=1)
            options = RequestOptions(cache_ttl_s=60, cache_salt=f"{salt_prefix}{i}")
            ids = [base + 50 * i + j for j in range(39)]
            core.add_request(ids, sp, tenant=tenant, options=options)
            run(core)

    hold(b, 3500, 1, "b")
    hold(a, 1000, 5, "a")  # five salts of one tenant: two holds fit its 20 blocks
    assert retention.num_tenant_held_blocks("a") == 20 and retention.num_held_blocks == 30
    assert retention.num_tenant_held_blocks("b") == 10  # b's older hold stays
    hold(c, 2000, 5, "c")  # its own share is 40 blocks, but the pool's bound leaves it 34
    assert retention.num_tenant_held_blocks("c") == 30 and retention.num_held_blocks == 60
    pressure = core.cache_pressure(lambda salt: salt is not None and salt[0] == "c", c)
    assert (pressure.held_blocks, pressure.max_held_blocks) == (30, 40)
    core.check_integrity()

    core = make_core(num_kv_blocks=80, retention_max_share=0.8, retention_max_tenant_share=0.25)
    hold(None, 1000, 8, "s")  # no tenants: one tenant, the pool's bound only
    assert core.scheduler.retention.num_held_blocks == 60
    core.check_integrity()


def test_a_waiting_request_does_not_take_an_older_hold_while_others_run():
    """A new request that needs an agent's held blocks waits while other work runs (it may
    not end an older lineage's hold for its own start), and gets them once nothing runs (so
    nothing deadlocks); a running request may take them."""
    core, _ = retention_core(retention_max_share=1.0)
    retention = core.scheduler.retention
    core.add_request([400 + j for j in range(95)], SamplingParams(max_tokens=1), rid="agent",
                     options=HOLD_30)  # fmt: skip
    run(core)  # 24 blocks held
    long = SamplingParams(max_tokens=24, ignore_eos=True)
    core.add_request([600 + j for j in range(8)], long, rid="running")  # up to 8 blocks
    core.step()
    new = [1000 + j for j in range(70)]  # 18 blocks: more than the 16 not held
    core.add_request(new, SamplingParams(max_tokens=1), rid="new")
    waited = 0
    while "running" in core.scheduler.requests:
        core.step()
        assert "agent" in retention.holds
        waited += core.scheduler.requests["new"] in core.scheduler.waiting
    assert waited > 0
    run(core)
    assert "agent" not in retention.holds  # given up once nothing else ran
    core.check_integrity()


def test_cache_pressure_reports_holds_against_the_share_as_data():
    """`cache_pressure()`: the pool, the held blocks and their share bound, the refusals and
    which finished requests are held, as plain data between steps."""
    core, _ = retention_core(retention_max_share=0.5)
    empty = core.cache_pressure()
    assert (empty.num_blocks, empty.max_held_blocks, empty.held_blocks) == (40, 20, 0)
    assert empty.room_blocks == 20 and empty.held == frozenset() and empty.block_size == 4
    hold = SamplingParams(max_tokens=1, ignore_eos=True)
    core.add_request([800 + j for j in range(59)], hold, rid="x0", options=HOLD_30)  # 15 blocks
    run(core)
    core.add_request(
        [900 + j for j in range(31)], hold, rid="y0", options=HOLD_30
    )  # 8 blocks: no room
    run(core)
    p = core.cache_pressure()
    assert p.held == frozenset({"x0"}) and p.held_blocks == 15 and p.room_blocks == 5
    assert p.holds_refused == 1 and p.free_blocks + p.evictable_blocks + 15 <= 40
    core.scheduler.retention.release("x0")
    assert core.cache_pressure().held == frozenset() and core.cache_pressure().room_blocks == 20
    core.check_integrity()


def test_engine_generate_takes_request_options_per_prompt(make_engine):
    """`Engine.generate(options=...)`: one RequestOptions for every prompt or one per prompt;
    a salt keeps a prompt's cached KV from other salts', and the list must match the prompts."""
    engine = make_engine()
    prompt = list(range(10, 50))
    greedy = SamplingParams(max_tokens=2, temperature=0)
    a, b = RequestOptions(cache_salt="a"), RequestOptions(cache_salt="b", priority=-1)
    engine.generate(prompt_token_ids=[prompt], sampling_params=greedy, options=a)
    outs = engine.generate(
        prompt_token_ids=[prompt, prompt], sampling_params=greedy, options=[b, a]
    )
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens > 0
    assert outs[0].token_ids == outs[1].token_ids
    with pytest.raises(ValueError, match="2 request options for 1 prompts"):
        engine.generate(prompt_token_ids=[prompt], sampling_params=greedy, options=[a, b])
    with pytest.raises(ValueError, match="cache_salt"):
        RequestOptions(cache_salt="x" * (MAX_CACHE_SALT_CHARS + 1))


def test_a_hold_keeps_only_device_blocks_when_its_last_token_is_cached_on_the_host():
    """A finished request's sampled token (no KV of its own) may continue into a host-only
    node, cached by an earlier request: the hold ends at the device part of the path, so
    loading that node later does not change the blocks the hold counts."""
    core = make_core(num_kv_blocks=40, host_blocks=200, retention_max_share=0.5)
    prefix = [900 + j for j in range(6)]
    tail = [ctx_token("", prefix)] + [950 + j for j in range(5)]  # the token `prefix` samples
    core.add_request(prefix + tail, SamplingParams(max_tokens=1), rid="long")
    run(core)
    fill(core, 1000, n=4)  # "long" goes to the host tier
    assert core.cache.match(prefix + tail).num_host_tokens == 12
    core.add_request(prefix, SamplingParams(max_tokens=1), rid="h", options=HOLD_30)
    run(core)
    hold = core.scheduler.retention.holds["h"]
    assert hold.blocks == core.cache.locked_blocks(hold.handle) and len(hold.blocks) == 2
    core.add_request(prefix + tail + [7], SamplingParams(max_tokens=1), rid="again")
    assert run(core)["again"] == 12  # loads the host-only rest of the path
    assert core.scheduler.retention.num_held_blocks == 2
