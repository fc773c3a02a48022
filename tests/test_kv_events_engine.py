"""KV events through EngineCore with a scripted runner: after every step, the event stream
(msgpack batches, as published) replayed into an empty index equals the full blocks the
cache holds per medium. Small pools force evictions and preemptions; n > 1 forks, aborts,
overlap and the host tier (write-back, loads, host eviction) all run."""

from __future__ import annotations

import random

import msgspec
import pytest
from test_host_tier_scheduler import MODEL, ctx_token
from test_kv_events import Index, tree_blocks

from radixrt.cache.kv_events import AllBlocksCleared, KVEventBatch
from radixrt.config import CacheConfig, EngineConfig, SchedulerConfig
from radixrt.engine.core import EngineCore
from radixrt.sampling import SamplingParams
from radixrt.testing import ScriptedRunner

EOS = 3


def make_core(*, overlap: bool, num_kv_blocks: int, host_blocks: int | None, kv_events=True):
    bs = 4
    sched = SchedulerConfig(policy="lpm", max_running_requests=8)
    cache = CacheConfig(
        block_size=bs,
        num_host_kv_blocks=host_blocks,
        kv_events=kv_events,
        kv_events_hash_seed="0",
    )
    cfg = EngineConfig(model_path="-", overlap_schedule=overlap, scheduler=sched, cache=cache)
    runner = ScriptedRunner(sched.max_running_requests, bs, context_fn=ctx_token)
    return EngineCore(cfg, MODEL, [EOS], runner=runner, num_kv_blocks=num_kv_blocks)


def step_and_check(core: EngineCore, index: Index, counts: dict) -> None:
    counts["steps"] = counts.get("steps", 0) + 1
    assert counts["steps"] < 3000, "the workload does not finish"
    core.step()
    events = core.take_kv_events()
    for e in events:
        key = (type(e).__name__, getattr(e, "medium", None))
        counts[key] = counts.get(key, 0) + 1
    index.apply(msgspec.msgpack.encode(KVEventBatch(0.0, events, 0)))
    assert index.blocks == tree_blocks(core.cache)


def run_workload(core: EngineCore, seed: int) -> dict:
    rng = random.Random(seed)
    index = Index()
    counts: dict = {}
    systems = [[100 + 50 * s + i for i in range(rng.randrange(5, 23))] for s in range(3)]
    histories: dict[int, list[int]] = {}
    for round_ in range(10):
        for k in range(rng.randrange(2, 5)):
            conv = rng.randrange(6)
            prompt = histories.get(conv, [])
            if not prompt or len(prompt) > 50:  # a new conversation (the pool holds 112 tokens)
                prompt = list(rng.choice(systems))
            prompt = prompt + [rng.randrange(10, 3000) for _ in range(rng.randrange(1, 14))]
            histories[conv] = prompt
            sp = SamplingParams(
                max_tokens=rng.randrange(1, 9), ignore_eos=True, n=rng.choice([1, 1, 2])
            )
            core.add_request(prompt, sp, rid=f"r{round_}-{k}")
        for _ in range(rng.randrange(1, 6)):
            if core.has_work:
                step_and_check(core, index, counts)
        if rng.random() < 0.3:
            core.abort(f"r{round_}-0")
        while core.has_work and rng.random() < 0.8:
            step_and_check(core, index, counts)
    while core.has_work:
        step_and_check(core, index, counts)
    core.check_integrity()
    core.cache.reset()
    events = core.take_kv_events()
    index.apply(msgspec.msgpack.encode(KVEventBatch(0.0, events, 0)))
    assert index.blocks == tree_blocks(core.cache) == {"GPU": {}, "CPU": {}}
    assert isinstance(events[-1], AllBlocksCleared)
    return counts


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("host_blocks", [None, 40])
def test_replayed_events_equal_the_cache_every_step(overlap, host_blocks):
    counts: dict = {"steps": 0}
    for seed in range(3):
        core = make_core(overlap=overlap, num_kv_blocks=28, host_blocks=host_blocks)
        for key, n in run_workload(core, seed).items():
            counts[key] = counts.get(key, 0) + n
    # the workloads reach every transition the configuration has
    assert counts[("BlockStored", "GPU")] and counts[("BlockRemoved", "GPU")]
    if host_blocks:
        assert counts[("BlockStored", "CPU")] and counts[("BlockRemoved", "CPU")]
    else:
        assert ("BlockStored", "CPU") not in counts


def test_events_off_records_nothing():
    core = make_core(overlap=False, num_kv_blocks=28, host_blocks=None, kv_events=False)
    core.add_request(list(range(100, 130)), SamplingParams(max_tokens=4, ignore_eos=True))
    while core.has_work:
        core.step()
    assert core.kv_events is None and core.take_kv_events() == []
    stack = list(core.cache.root.children.values())
    while stack:
        node = stack.pop()
        assert node.block_hashes is None
        stack += node.children.values()


def test_kv_events_need_the_radix_cache():
    with pytest.raises(ValueError, match="kv_events need prefix_cache 'radix'"):
        CacheConfig(prefix_cache="blockhash", kv_events=True)
