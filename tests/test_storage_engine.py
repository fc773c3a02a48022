"""The storage KV tier with the tiny model on CPU: a restarted engine with the same
`kv_storage` directory finds its earlier prefixes there; greedy outputs equal a run without the
tier, also with pools far below the working set and after pages are corrupted or deleted behind
the engine's back; tenants' salts keep their pages apart."""

from __future__ import annotations

import dataclasses

import pytest

from radixrt import SamplingParams
from radixrt.cache.storage_local import HEADER

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
# long enough to wait for any fetch on a loaded machine: the outputs must not depend on timing
STORAGE = dict(
    block_size=4,
    num_kv_blocks=48,
    num_host_kv_blocks=64,
    kv_storage_prefetch_timeout_s=60.0,
)


def prompts(n=4, length=41):
    return [[10 + (7 * p + 3 * i) % 150 for i in range(length)] for p in range(n)]


def run(engine, batch, params=GREEDY):
    """Each prompt alone (its own step sequence); outputs and cached prompt tokens by index."""
    out, cached = {}, {}
    for i, ids in enumerate(batch):
        engine.add_request(ids, params, rid=f"r{i}")
        while engine.core.has_work:
            for d, _ in engine.step():
                out.setdefault(i, []).extend(d.new_token_ids)
                cached[i] = d.num_cached_tokens
    engine.check_integrity()
    return out, cached


def settle(engine):
    """Let the engine's storage writes finish (they run in the background)."""
    engine.core.runner.storage.drain()


def test_restart_finds_earlier_prefixes(make_engine, tmp_path):
    batch = prompts()
    want, _ = run(make_engine(block_size=4), batch)
    first = make_engine(kv_storage=str(tmp_path), **STORAGE)
    assert run(first, batch)[0] == want
    settle(first)
    s = first.stats()
    assert s["storage_written_pages"] >= len(batch) * 10 and s["storage_write_drops"] == 0
    first.core.shutdown()  # the runner finishes its storage writes

    again = make_engine(kv_storage=str(tmp_path), **STORAGE)
    out, cached = run(again, batch)
    assert out == want
    # every full page of each prompt but its last token's came back from storage
    assert all(cached[i] == 40 for i in range(len(batch)))
    s = again.stats()
    assert s["storage_fetches"] == len(batch) and s["storage_fetched_pages"] == 40
    assert s["storage_hits"] == 40 and s["storage_prefetch_timeouts"] == 0
    assert s["host_loaded_blocks"] >= 40


def test_corrupt_or_deleted_pages_are_recomputed(make_engine, tmp_path):
    batch = prompts()
    want, _ = run(make_engine(block_size=4), batch)
    first = make_engine(kv_storage=str(tmp_path), **STORAGE)
    run(first, batch)
    settle(first)
    first.core.shutdown()  # the runner finishes its storage writes
    pages = sorted(tmp_path.rglob("*.kvpage"))
    assert len(pages) >= 40
    for k, path in enumerate(pages):
        if k % 3 == 0:
            data = bytearray(path.read_bytes())
            data[HEADER.size + len(data) // 2 % 100] ^= 0x55
            path.write_bytes(bytes(data))
        elif k % 3 == 1:
            path.unlink()

    again = make_engine(kv_storage=str(tmp_path), **STORAGE)
    out, _ = run(again, batch)
    assert out == want
    s = again.stats()
    assert s["storage_corrupt_pages"] > 0 and s["storage_misses"] > 0


def test_salts_share_no_page(make_engine, tmp_path):
    batch = prompts(2)
    first = make_engine(kv_storage=str(tmp_path), **STORAGE)
    run(first, batch, dataclasses.replace(GREEDY, cache_salt="tenant-a"))
    settle(first)
    first.core.shutdown()  # the runner finishes its storage writes
    again = make_engine(kv_storage=str(tmp_path), **STORAGE)
    _, cached = run(again, batch, dataclasses.replace(GREEDY, cache_salt="tenant-b"))
    assert cached == {0: 0, 1: 0}
    assert again.stats()["storage_hits"] == 0
    _, cached = run(again, batch, dataclasses.replace(GREEDY, cache_salt="tenant-a"))
    assert cached == {0: 40, 1: 40}


@pytest.mark.parametrize("overlap", [False, True])
def test_pools_below_the_working_set_match(make_engine, tmp_path, overlap):
    """Multi-turn chats whose history leaves GPU and host memory: storage brings it back."""
    convs, turns = 6, 3
    hist = {c: [10 + (7 * c + i) % 150 for i in range(24)] for c in range(convs)}

    def chat(engine):
        h = {c: list(v) for c, v in hist.items()}
        out = {}
        for t in range(turns):
            for c in range(convs):
                h[c] += [20 + (11 * c + 5 * t + i) % 170 for i in range(9)]
                engine.add_request(h[c], GREEDY, rid=f"c{c}t{t}")
                while engine.core.has_work:
                    for d, _ in engine.step():
                        out.setdefault(d.rid, []).extend(d.new_token_ids)
                h[c] += out[f"c{c}t{t}"]
            engine.check_integrity()
        return out

    want = chat(make_engine(block_size=4, overlap_schedule=overlap))
    small = dict(STORAGE, num_kv_blocks=24, num_host_kv_blocks=16)
    eng = make_engine(kv_storage=str(tmp_path), overlap_schedule=overlap, **small)
    assert chat(eng) == want
    s = eng.stats()
    assert s["storage_adopted_pages"] > 0 and s["host_evicted_blocks"] > 0
