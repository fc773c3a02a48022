"""Load or recompute: the storage tier's cost model (radixrt.cache.storage_cost) on its own,
in a scheduler driven by a scripted runner, a scripted clock and a fake store whose timings
are scripted (a slow store makes the scheduler compute, a fast one makes it load; `always` and
`never` override; the counters count), and on the tiny model engine (greedy outputs do not
depend on the policy)."""

from __future__ import annotations

import pytest

from radixrt.cache.namespace import DEFAULT_NAMESPACE
from radixrt.cache.radix_storage import StorageRadixCache
from radixrt.cache.storage import (
    FetchDone,
    FetchPages,
    PageKeyer,
    StorageIdentity,
    StorageTier,
    StorePage,
)
from radixrt.cache.storage_cost import (
    PROBE_EVERY,
    SEED_READ_BANDWIDTH,
    Choice,
    DecayedRatio,
    StorageCostModel,
)
from radixrt.cache.tiers import HostTier
from radixrt.config import CacheConfig, SchedulerConfig
from radixrt.kv.allocator import BlockAllocator
from radixrt.sampling import SamplingParams
from radixrt.scheduler.request import Request
from radixrt.scheduler.scheduler import Scheduler
from radixrt.testing import ScriptedRunner

BS = 4
PAGE_BYTES = 4096
STEP_S = 0.01  # every scripted step takes this long on the scripted clock
IDENTITY = StorageIdentity("tiny", "r", "float32", "", "page-first")


# ---- the model alone ----
def test_decayed_ratio_is_its_seed_until_sampled_then_weighs_by_size():
    r = DecayedRatio(seed=5.0)
    assert r.value == 5.0
    r.add(100, 0.0)  # no time: no sample
    assert r.value == 5.0 and r.samples == 0
    r.add(100, 1.0)
    assert r.value == 100.0
    r.add(1, 1.0)  # (100 * 0.8 + 1) / (1 * 0.8 + 1)
    assert r.value == pytest.approx(81 / 1.8)
    assert DecayedRatio().value is None


def test_decision_compares_measured_load_and_recompute_times():
    m = StorageCostModel()
    assert m.decide(10, 40) is Choice.LOAD  # nothing measured yet: a fetch measures
    m.observe_fetch(0, PAGE_BYTES, 0.001, 0.0)  # a miss: page size and latency, no bandwidth
    assert m.read_bandwidth.value == SEED_READ_BANDWIDTH
    assert m.decide(10, 40) is Choice.LOAD  # no prefill measured yet
    m.observe_prefill(4000, 1.0)  # 4000 tokens/s: 40 tokens cost 10 ms
    m.observe_fetch(10, PAGE_BYTES, 0.001, 0.5)  # 10 pages in 0.5 s
    assert m.load_seconds(10) == pytest.approx(0.501)
    assert m.recompute_seconds(40) == pytest.approx(0.01)
    assert m.decide(10, 40) is Choice.RECOMPUTE
    choices = [m.decide(10, 40) for _ in range(PROBE_EVERY)]
    assert choices.count(Choice.PROBE) == 1 and choices[-2] is Choice.PROBE
    for _ in range(30):  # the store got fast: the decayed sums follow
        m.observe_fetch(10, PAGE_BYTES, 0.0001, 0.0001)
    assert m.decide(10, 40) is Choice.LOAD
    with pytest.raises(ValueError, match="kv_storage_load_policy"):
        StorageCostModel("sometimes")


def test_the_option_is_validated():
    with pytest.raises(ValueError, match="kv_storage_load_policy"):
        CacheConfig(kv_storage_load_policy="sometimes")


# ---- the scheduler with a fake store ----
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeStore:
    """The runner's side of the storage tier: keeps written keys, answers fetches with
    scripted timings."""

    def __init__(self, read_s_per_page: float, lookup_s: float = 0.001) -> None:
        self.read_s_per_page = read_s_per_page
        self.lookup_s = lookup_s
        self.keys: set[bytes] = set()
        self.fetches: list[FetchPages] = []

    def exchange(self, ops) -> list[FetchDone]:
        done = []
        for op in ops:
            if isinstance(op, StorePage):
                self.keys.add(op.key)
            elif isinstance(op, FetchPages):
                self.fetches.append(op)
                num = next((i for i, k in enumerate(op.keys) if k not in self.keys), len(op.keys))
                read_s = num * self.read_s_per_page
                done.append(FetchDone(op.ticket, num, PAGE_BYTES, self.lookup_s, read_s))
        return done


def make(policy: str, store: FakeStore):
    clock = Clock()
    tier = StorageTier(PageKeyer(IDENTITY, BS), 60.0, StorageCostModel(policy))
    alloc = BlockAllocator(128)
    cache = StorageRadixCache(alloc, BS, HostTier(64), tier)
    cfg = SchedulerConfig(max_running_requests=4)
    sched = Scheduler(cfg, alloc, cache, max_model_len=512, eos_token_ids=[3], clock=clock)
    runner = ScriptedRunner(4, BS)
    return sched, cache, tier, runner, clock


def drain(sched, cache, tier, runner, clock, store) -> int:
    """Run to the end as the engine loop does; returns the steps that ran."""
    steps = 0
    while sched.has_work:
        cache.finish_storage_io(store.exchange(tier.take_ops()))
        plan = sched.schedule()
        if plan is None:
            continue
        clock.now += STEP_S
        sched.update(plan, runner.execute(plan).result())
        steps += 1
    cache.finish_storage_io(store.exchange(tier.take_ops()))
    sched.check_integrity()
    cache.check_integrity()
    return steps


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, len(tokens), list(tokens), SamplingParams(max_tokens=2), 2)


def run_case(policy: str, read_s_per_page: float):
    """A first request (its prefix is in the store and the model unmeasured: it loads), then
    a request whose 10 pages are in the store and in no pool: what does the scheduler do?"""
    store = FakeStore(read_s_per_page)
    sched, cache, tier, runner, clock = make(policy, store)
    first = [1000 + i for i in range(41)]
    second = [2000 + i for i in range(41)]
    store.keys.update(tier.keyer.keys(first, DEFAULT_NAMESPACE))
    store.keys.update(tier.keyer.keys(second, DEFAULT_NAMESPACE))
    sched.add_request(request("warm", [5000 + i for i in range(200)]))  # times a prefill
    drain(sched, cache, tier, runner, clock, store)
    sched.add_request(request("first", first))
    drain(sched, cache, tier, runner, clock, store)
    fetches_before = len(store.fetches)
    sched.add_request(request("second", second))
    drain(sched, cache, tier, runner, clock, store)
    second_fetched = len(store.fetches) > fetches_before
    return tier, cache.storage.cost, second_fetched, cache.match(second[:40]).num_cached_tokens


def test_a_slow_store_makes_the_scheduler_recompute():
    # 0.1 s a page: 10 pages cost 1 s, 40 tokens a fraction of one 10 ms step
    tier, cost, fetched, cached = run_case("auto", 0.1)
    # only "warm"'s step computed enough prompt tokens to time the prefill
    assert cost.prefill_throughput.value == pytest.approx(200 / STEP_S)
    assert cost.prefill_throughput.samples == 1 and cost.read_bandwidth.samples == 1
    assert cost.read_bandwidth.value == pytest.approx(PAGE_BYTES / 0.1)
    assert not fetched and cached == 40  # computed, then cached
    s = tier.stats
    # "warm" loaded (unmeasured; the store lacked it), "first" too (the seed bandwidth)
    assert (s.loads_chosen, s.recomputes_chosen, s.probe_fetches) == (2, 1, 0)
    assert s.prefetch_waits == 2


def test_a_fast_store_makes_the_scheduler_load():
    tier, cost, fetched, cached = run_case("auto", 1e-7)
    assert fetched and cached == 40
    s = tier.stats
    assert (s.loads_chosen, s.recomputes_chosen) == (3, 0)
    assert s.pages_adopted == 20  # "first"'s and "second"'s pages came from the store


def test_always_loads_from_a_slow_store():
    tier, _, fetched, _ = run_case("always", 0.1)
    assert fetched and (tier.stats.loads_chosen, tier.stats.recomputes_chosen) == (3, 0)


def test_never_reads_a_fast_store():
    tier, cost, fetched, cached = run_case("never", 1e-7)
    assert not fetched and cached == 40
    s = tier.stats
    assert (s.loads_chosen, s.recomputes_chosen, s.fetches) == (0, 3, 0)
    assert cost.prefill_throughput.samples >= 1  # measured all the same


def test_step_time_counts_from_launch_or_the_previous_result():
    """Steps planned: their prompt tokens over the scripted clock's step times (overlapped:
    the second step's time starts at the first's result)."""
    store = FakeStore(1e-7)
    sched, cache, tier, runner, clock = make("never", store)
    sched.add_request(request("a", list(range(100, 260))))  # 160 prompt tokens, one step
    plan = sched.schedule()
    clock.now += 0.5
    sched.add_request(request("b", list(range(300, 460))))
    second = sched.schedule()  # planned while the first runs
    clock.now += 0.5
    sched.update(plan, runner.execute(plan).result())
    assert cache.storage.cost.prefill_throughput.value == pytest.approx(160 / 1.0)
    clock.now += 0.25
    sched.update(second, runner.execute(second).result())
    assert cache.storage.cost.prefill_throughput.value == pytest.approx(
        (160 * 0.8 + 160) / (1.0 * 0.8 + 0.25)
    )
    sched.add_request(request("c", list(range(500, 540))))  # 40 tokens: too few to time
    drain(sched, cache, tier, runner, clock, store)
    assert cache.storage.cost.prefill_throughput.samples == 2


# ---- the tiny model engine ----
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
STORAGE = dict(
    block_size=4, num_kv_blocks=96, num_host_kv_blocks=64, kv_storage_prefetch_timeout_s=60.0
)


def test_greedy_output_does_not_depend_on_the_policy(make_engine, tmp_path):
    batch = [[10 + (7 * p + 3 * i) % 150 for i in range(41)] for p in range(3)]

    def run(engine, prompts):
        out = {}
        for i, ids in enumerate(prompts):
            engine.add_request(ids, GREEDY, rid=f"r{i}")
            while engine.core.has_work:
                for d, _ in engine.step():
                    out.setdefault(i, []).extend(d.new_token_ids)
        engine.check_integrity()
        return out

    first = make_engine(kv_storage=str(tmp_path), **STORAGE)
    run(first, batch)
    first.core.runner.storage.drain()
    first.core.shutdown()
    # each engine first gets a long prompt of its own, not in storage: its prefill is timed
    policies = ("never", "always", "auto")
    longs = [[200 + k + i % 50 for i in range(201)] for k in range(len(policies))]
    plain = run(make_engine(**STORAGE), longs + batch)
    for k, policy in enumerate(policies):
        eng = make_engine(kv_storage=str(tmp_path), kv_storage_load_policy=policy, **STORAGE)
        out = run(eng, [longs[k]] + batch)
        assert out == {0: plain[k], **{1 + i: plain[3 + i] for i in range(len(batch))}}, policy
        s = eng.stats()
        assert s["storage_loads_chosen"] + s["storage_recomputes_chosen"] == 1 + len(batch)
        if policy == "never":
            assert s["storage_fetches"] == 0 and s["storage_recomputes_chosen"] == 1 + len(batch)
        if policy == "always":
            assert s["storage_hits"] == 30 and s["storage_loads_chosen"] == 1 + len(batch)
        if policy == "auto":  # the first prefix loads: nothing was measured
            assert s["storage_loads_chosen"] >= 1
            assert s["storage_read_bandwidth_bytes_per_second"] > 0
            assert s["storage_fetch_latency_seconds"] > 0
            assert s["storage_prefill_tokens_per_second"] > 0
        eng.core.shutdown()
