"""The host KV tier with the tiny model: greedy outputs of a device pool far smaller than the
working set plus a host tier equal an unconstrained run (multi-turn and agent-style prompts,
overlap on and off), with host hits; both pools intact after every workload."""

from __future__ import annotations

import pytest
import torch

from radixrt import SamplingParams
from radixrt.kv.host_pool import HostKVPool, _runs, num_host_blocks
from radixrt.kv.pool import KVPool
from radixrt.plan import SwapIn, SwapOut

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def drain(engine, out):
    while engine.core.has_work:
        for d, _ in engine.step():
            out.setdefault(d.rid, []).extend(d.new_token_ids)
    engine.check_integrity()
    check_pools(engine)


def check_pools(engine):
    cache, alloc = engine.cache, engine.allocator
    assert alloc.num_free + cache.cached_blocks == alloc.num_blocks
    if cache.host is not None:
        h = cache.host.allocator
        assert h.num_free + cache.host_cached_blocks == h.num_blocks


def multi_turn(engine, convs=4, turns=3, batch=2):
    hist = {c: [10 + (7 * c + i) % 150 for i in range(16)] for c in range(convs)}
    out = {}
    for t in range(turns):
        for lo in range(0, convs, batch):
            group = range(lo, min(lo + batch, convs))
            for c in group:
                hist[c] += [20 + (11 * c + 5 * t + i) % 170 for i in range(12)]
                engine.add_request(hist[c], GREEDY, rid=f"c{c}t{t}")
            drain(engine, out)
            for c in group:
                hist[c] += out[f"c{c}t{t}"]
    return out


def agent(engine, agents=4, steps=4):
    system = [30 + i % 100 for i in range(40)]
    hist = {a: system + [200 + a] for a in range(agents)}
    out = {}
    for s in range(steps):
        for a in range(agents):
            hist[a] += [40 + 13 * a + s] * 5
            engine.add_request(hist[a], GREEDY, rid=f"a{a}s{s}")
        drain(engine, out)
        for a in range(agents):
            hist[a] += out[f"a{a}s{s}"]
    return out


@pytest.mark.parametrize("workload", [multi_turn, agent])
@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_model_host_tier_matches_unconstrained(make_engine, workload, overlap):
    ref = make_engine(block_size=4, overlap_schedule=overlap)
    want = workload(ref)
    eng = make_engine(
        block_size=4, num_kv_blocks=32, num_host_kv_blocks=256, overlap_schedule=overlap
    )
    assert workload(eng) == want
    s = eng.core.stats()
    assert s["host_hit_tokens"] > 0 and s["host_loaded_blocks"] > 0
    per_block = eng.core.runner.host_pool.bytes_per_block
    assert s["swap_in_bytes"] == s["host_loaded_blocks"] * per_block
    assert s["swap_out_bytes"] == s["host_written_back_blocks"] * per_block > 0
    assert s["host_kv_blocks_total"] == 256 and s["swap_seconds"] > 0


def test_host_pool_copies_round_trip():
    pool = KVPool(2, 6, 4, 2, 8, torch.float32, "cpu")
    pool.kv.normal_()
    host = HostKVPool(5, pool)
    before = pool.kv.clone()
    host.execute([SwapOut(1, 3), SwapOut(2, 4), SwapOut(5, 0)], set(), set())
    pool.kv.zero_()
    host.execute([SwapIn(3, 0), SwapIn(0, 2), SwapIn(4, 3)], set(), set())
    assert torch.equal(pool.kv[:, :, 0], before[:, :, 1])
    assert torch.equal(pool.kv[:, :, 2], before[:, :, 5])
    assert torch.equal(pool.kv[:, :, 3], before[:, :, 2])
    st = host.stats()
    assert st.blocks_out == st.blocks_in == 3 and st.bytes_in == 3 * host.bytes_per_block
    assert _runs([3, 4, 0, 7, 8, 9]) == [(0, 2, 3), (2, 3, 0), (3, 6, 7)]


def test_host_tier_larger_than_memory_is_a_clear_error():
    with pytest.raises(ValueError, match="available host memory"):
        num_host_blocks(1e6, None, 2**20)  # a million GiB
    with pytest.raises(ValueError, match="holds no KV block"):
        num_host_blocks(1e-9, None, 2**20)
    assert num_host_blocks(2**-10, None, 2**10) == 1024 and num_host_blocks(9, 5, 2**10) == 5


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = dict(device="cuda", block_size=4, max_num_batched_tokens=64)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("workload", [multi_turn, agent])
def test_gpu_host_tier_fp32_matches_unconstrained(make_engine, workload):
    """float32, torch attention: the loaded KV is bit-identical, so greedy outputs agree."""
    opts = dict(CUDA, dtype="float32", attention_backend="torch")
    want = workload(make_engine(**opts))
    eng = make_engine(**opts, num_kv_blocks=32, num_host_kv_blocks=256)
    assert workload(eng) == want
    s = eng.core.stats()
    assert s["host_hit_tokens"] > 0 and s["swap_seconds"] > 0


@pytest.mark.gpu
@gpu
def test_gpu_host_tier_bf16_flashinfer_overlap_on_off(make_engine):
    """bf16, FlashInfer, CUDA graphs: the copy stream and its fences give the same tokens
    with overlap on and off (the same plans), and mostly those of an unconstrained run (bf16
    numerics differ with the batch composition)."""
    opts = dict(CUDA, dtype="bfloat16", attention_backend="flashinfer", enable_cuda_graph=True)
    outs = {}
    for overlap in (False, True):
        eng = make_engine(
            **opts, num_kv_blocks=32, num_host_kv_blocks=256, overlap_schedule=overlap
        )
        outs[overlap] = multi_turn(eng)
        assert eng.core.stats()["host_hit_tokens"] > 0
    assert outs[True] == outs[False]
    ref = multi_turn(make_engine(**opts))
    same = sum(ref[k] == outs[True][k] for k in ref)
    assert same >= 0.75 * len(ref), f"{same}/{len(ref)} calls agree"


def test_host_tier_metrics(make_engine):
    """The snapshot carries the host-tier counters of EngineCore.stats(); /metrics has them."""
    from radixrt.server.messages import SchedulerSnapshot
    from radixrt.server.metrics import ServerMetrics

    eng = make_engine(block_size=4, num_kv_blocks=32, num_host_kv_blocks=64)
    multi_turn(eng)
    s = eng.core.stats()
    assert s["host_kv_blocks_cached"] + s["host_kv_blocks_free"] == 64
    snap = SchedulerSnapshot(eng.core.stats_struct())
    m = ServerMetrics()
    m.update(snap)
    text = m.render().decode()
    assert f"radixrt_host_hit_tokens {float(s['host_hit_tokens'])}" in text
    assert s["host_hit_tokens"] > 0 and "radixrt_swap_seconds" in text
    assert s["swap_in_bytes"] > 0  # the runner's swap_stats(): the loads it copied


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_model_preemption_with_host_tier(make_engine, overlap):
    """Decode rows preempt each other in a tiny pool; outputs still match."""
    long = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def work(engine):
        out = {}
        for i in range(6):
            engine.add_request([10 + (5 * i + j) % 120 for j in range(20)], long, rid=f"p{i}")
        drain(engine, out)
        for i in range(6):  # a second turn over the evicted histories
            prompt = [10 + (5 * i + j) % 120 for j in range(20)] + out[f"p{i}"] + [77, 78]
            engine.add_request(prompt, long, rid=f"q{i}")
        drain(engine, out)
        return out

    want = work(make_engine(block_size=4, overlap_schedule=overlap))
    eng = make_engine(
        block_size=4, num_kv_blocks=24, num_host_kv_blocks=128, overlap_schedule=overlap
    )
    assert work(eng) == want
    s = eng.core.stats()
    assert s["preemptions"] > 0 and s["host_hit_tokens"] > 0
