"""Differential soak: one seeded mixed workload (shared prefixes, long and short prompts;
greedy rows interleaved with streamed, grammar-constrained, n > 1, beam-search and sampled
rows; aborts and client disconnects) against a plain `radixrt serve` and against servers with
features on under KV pressure (`benchmarks.differential.CONFIGS`: host tier, ngram
speculation, both; and a storage tier across restarts and damage to its pages): every greedy
answer the same, and the KV accounting balanced once idle.

Two drivers of the same workload: real server processes (the workload goes through the front:
streams, /abort, dropped connections, concurrency as clients make it; on the CPU the server
runs without overlap scheduling), and in-process engines (`benchmarks.differential_engine`:
arrivals and aborts at seeded steps, so a difference replays exactly, and overlap scheduling
on). `benchmarks/soak_differential.py` runs the server check longer.
"""

from __future__ import annotations

import pytest
from conftest import assert_idle
from server_utils import serving

from benchmarks import differential_engine
from benchmarks.differential import (
    CONFIGS,
    HOST,
    PRESSURE,
    REFERENCE_ARGS,
    check_balanced,
    compare,
    make_workload,
    run_workload,
)

SEED = 7
NUM_REQUESTS = 100
CONCURRENCY = 12


@pytest.fixture(scope="module")
def workload():
    return make_workload(SEED, NUM_REQUESTS)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, workload):
    with serving(tiny_model_dir, *REFERENCE_ARGS) as srv:
        answers = run_workload(srv.url, workload, CONCURRENCY, fates=False)
        check_balanced(srv.url)
    return answers


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_answers_match_the_plain_server(tiny_model_dir, workload, reference, name):
    with serving(tiny_model_dir, *CONFIGS[name]) as srv:
        answers = run_workload(srv.url, workload, CONCURRENCY)
        snap = check_balanced(srv.url)
    result = compare(workload, reference, answers)
    assert not result.mismatches, "\n".join(result.mismatches[:10])
    assert result.num_compared >= NUM_REQUESTS // 2
    # the workload exercised what it is for
    assert snap["preemptions"] > 0 and snap["forks"] > 0 and snap["beam_steps"] > 0
    if "--host-kv-gb" in CONFIGS[name]:
        assert snap["host_loaded_blocks"] > 0 and snap["host_written_back_blocks"] > 0
    if "--speculative-method" in CONFIGS[name]:
        assert snap["spec_accepted_tokens"] > 0
    kinds = {job.kind for job in workload}
    fates = {job.fate for job in workload}
    assert {"grammar", "beam", "greedy_n", "sampled_n"} <= kinds
    assert {"abort", "disconnect"} <= fates


def _damage(store) -> tuple[int, int]:
    """Behind the server's back: of every three pages, delete one and corrupt one's payload."""
    pages = sorted(store.rglob("*.kvpage"))
    for path in pages[0::3]:
        path.unlink()
    for path in pages[1::3]:
        data = bytearray(path.read_bytes())
        data[-100:] = bytes(b ^ 0xFF for b in data[-100:])
        path.write_bytes(bytes(data))
    return len(pages[0::3]), len(pages[1::3])


def test_storage_tier_across_restarts_matches_the_plain_server(
    tiny_model_dir, workload, reference, tmp_path
):
    """The storage tier (a directory) under the host tier and KV pressure: a server that
    fills the store, a restarted one that reads it, and one more after a third of its pages
    were deleted and a third corrupted. Every greedy answer equals the plain server's."""
    store = tmp_path / "kv"
    args = [*PRESSURE, *HOST, "--kv-storage", str(store)]
    for run in ("fill", "restart", "damaged"):
        if run == "damaged":
            deleted, corrupted = _damage(store)
            assert deleted and corrupted
        with serving(tiny_model_dir, *args) as srv:
            answers = run_workload(srv.url, workload, CONCURRENCY)
            snap = check_balanced(srv.url)
        result = compare(workload, reference, answers)
        assert not result.mismatches, (run, "\n".join(result.mismatches[:10]))
        assert result.num_compared >= NUM_REQUESTS // 2
        assert snap["storage_written_pages"] > 0 or run != "fill", snap
        if run != "fill":
            assert snap["storage_hits"] > 0, snap  # found what an earlier server stored
        if run == "damaged":
            assert snap["storage_corrupt_pages"] + snap["storage_misses"] > 0, snap


ENGINE_SEED = 2  # a run where a copy queued into a freed block met a host load into it
ENGINE_REQUESTS = 150


@pytest.fixture(scope="module")
def engine_workload():
    return make_workload(ENGINE_SEED, ENGINE_REQUESTS)


@pytest.fixture(scope="module")
def engine_reference(tiny_model_dir, engine_workload):
    from radixrt import Engine

    options = differential_engine.REFERENCE_OPTIONS
    engine = Engine(tiny_model_dir, device="cpu", dtype="float32", **options)
    try:
        answers = differential_engine.run_in_process(
            engine.core, engine_workload, ENGINE_SEED, CONCURRENCY, fates=False
        )
        assert_idle(engine)
    finally:
        engine.shutdown()
    return answers


@pytest.mark.parametrize("name", list(differential_engine.CONFIGS))
def test_in_process_greedy_answers_match_the_plain_engine(
    make_engine, engine_workload, engine_reference, name
):
    engine = make_engine(**differential_engine.CONFIGS[name])
    answers = differential_engine.run_in_process(
        engine.core, engine_workload, ENGINE_SEED, CONCURRENCY
    )
    result = compare(engine_workload, engine_reference, answers)
    assert not result.mismatches, "\n".join(result.mismatches[:10])
    assert result.num_compared >= ENGINE_REQUESTS // 2
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["forks"] > 0 and stats["host_loaded_blocks"] > 0
    alloc = engine.allocator
    assert alloc.num_free + engine.cache.cached_blocks == alloc.num_blocks
