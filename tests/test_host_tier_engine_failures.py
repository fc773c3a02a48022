"""Failed steps around host-tier transfers with the tiny model (CPU, float32): a step with
swap-ins fails before it ran anything or after it ran everything; the requests of that step
fail, a request whose history loaded in it without a row there and later requests for the same
prompt get the greedy output of an unconstrained run; both pools balance. Also an abort while
a request's history loads."""

from __future__ import annotations

import pytest
import torch
from test_host_tier_engine import check_pools
from test_host_tier_failures import fail_once, has_swap_in

from radixrt import SamplingParams
from radixrt.deltas import FinishReason

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
HISTORY = [10 + (7 * i) % 150 for i in range(40)]
PROMPT = HISTORY + [77, 78]


def drain(engine, out, reasons=None):
    while engine.core.has_work:
        for d, _ in engine.step():
            out.setdefault(d.rid, []).extend(d.new_token_ids)
            if reasons is not None and d.finish_reason is not None:
                reasons[d.rid] = d.finish_reason
    engine.check_integrity()
    check_pools(engine)


def history_on_host(engine):
    engine.add_request(HISTORY, GREEDY, rid="warm")
    drain(engine, {})
    for i in range(3):
        engine.add_request([20 + (11 * i + j) % 160 for j in range(30)], GREEDY, rid=f"f{i}")
        drain(engine, {})
    assert engine.cache.match(HISTORY).num_host_tokens == len(HISTORY)


@pytest.fixture
def want(make_engine):
    ref = make_engine(block_size=4)
    out = {}
    for rid in ("V", "again"):
        ref.add_request(PROMPT, GREEDY, rid=rid)
        drain(ref, out)
    assert out["V"] == out["again"]
    return out["V"]


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("ran", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_model_failed_loading_step(make_engine, want, overlap, ran, deferred):
    eng = make_engine(
        block_size=4, num_kv_blocks=32, num_host_kv_blocks=256, overlap_schedule=overlap
    )
    history_on_host(eng)
    if deferred:  # A's decode row carries V's loads
        eng.add_request([30 + i for i in range(8)], GREEDY, rid="A")
        eng.step()
    failed = fail_once(eng.core.runner, has_swap_in, ran=ran)
    eng.add_request(PROMPT, GREEDY, rid="V")
    out, reasons = {}, {}
    drain(eng, out, reasons)
    assert failed and eng.core.stats()["failed_steps"] == 1
    if deferred:
        assert [r.rid for r in failed[0].rows] == ["A"], "V's load was not deferred"
        assert reasons["A"] is FinishReason.ERROR
        assert out["V"] == want
    else:
        assert reasons["V"] is FinishReason.ERROR
    eng.add_request(PROMPT, GREEDY, rid="again")
    drain(eng, out)
    assert out["again"] == want


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_model_abort_of_a_deferred_load(make_engine, want, overlap):
    """V's history loads in a step in which V has no row yet; V is aborted then: nothing
    leaks and the same prompt reuses the loaded copy, with the unconstrained output."""
    eng = make_engine(
        block_size=4, num_kv_blocks=32, num_host_kv_blocks=256, overlap_schedule=overlap
    )
    history_on_host(eng)
    eng.add_request([30 + i for i in range(8)], GREEDY, rid="A")
    eng.step()
    eng.add_request(PROMPT, GREEDY, rid="V")
    eng.step()
    s = eng.core.stats()
    assert s["host_deferred_loads"] == 1 and eng.core.request("V").num_output == 0
    eng.abort("V")
    drain(eng, {})
    loaded = eng.core.stats()["host_loaded_blocks"]
    out = {}
    eng.add_request(PROMPT, GREEDY, rid="again")
    drain(eng, out)
    assert out["again"] == want
    assert eng.core.stats()["host_loaded_blocks"] == loaded, "the loaded copy was not reused"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ran", [False, True])
def test_gpu_failed_deferred_loading_step(make_engine, ran):
    """On the copy stream (float32, torch attention, overlap): the failed step's loads are
    forgotten, V and a later identical request get the unconstrained greedy output."""
    opts = dict(device="cuda", dtype="float32", attention_backend="torch", block_size=4)
    ref = make_engine(**opts)
    want = {}
    ref.add_request(PROMPT, GREEDY, rid="V")
    drain(ref, want)
    eng = make_engine(**opts, num_kv_blocks=32, num_host_kv_blocks=256, overlap_schedule=True)
    history_on_host(eng)
    eng.add_request([30 + i for i in range(8)], GREEDY, rid="A")
    eng.step()
    failed = fail_once(eng.core.runner, has_swap_in, ran=ran)
    eng.add_request(PROMPT, GREEDY, rid="V")
    out, reasons = {}, {}
    drain(eng, out, reasons)
    assert failed and [r.rid for r in failed[0].rows] == ["A"]
    assert reasons["A"] is FinishReason.ERROR and out["V"] == want["V"]
    eng.add_request(PROMPT, GREEDY, rid="again")
    drain(eng, out)
    assert out["again"] == want["V"]
