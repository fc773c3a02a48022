"""The storage KV tier with the tiny model on CPU, on both backends (a directory, and a real
redis-server from tests/redis_server.py): a restarted engine with the same `kv_storage` finds
its earlier prefixes there; greedy outputs equal a run without the tier, also with pools far
below the working set and after pages are corrupted or deleted behind the engine's back;
tenants' salts keep their pages apart; two engines on one store reuse each other's pages;
an engine whose Redis dies mid-run serves on, computing, and uses the store again when it is
back."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
from redis_server import RedisServer, redis_server  # noqa: F401 (a fixture)

from radixrt import RequestOptions, SamplingParams
from radixrt.cache.storage import HEADER
from radixrt.sampling import DEFAULT_OPTIONS

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


def run(engine, batch, params=GREEDY, options=DEFAULT_OPTIONS):
    """Each prompt alone (its own step sequence); outputs and cached prompt tokens by index."""
    out, cached = {}, {}
    for i, ids in enumerate(batch):
        engine.add_request(ids, params, rid=f"r{i}", options=options)
        while engine.core.has_work:
            for d, _ in engine.step():
                out.setdefault(i, []).extend(d.new_token_ids)
                cached[i] = d.num_cached_tokens
    engine.check_integrity()
    return out, cached


def settle(engine):
    """Let the engine's storage writes finish (they run in the background)."""
    engine.core.runner.storage.drain()


class DirStore:
    def __init__(self, root: Path) -> None:
        self.spec = str(root)
        self.root = root

    def damage(self) -> None:
        """Corrupt a third of the pages, delete another third."""
        pages = sorted(self.root.rglob("*.kvpage"))
        assert len(pages) >= 40
        for k, path in enumerate(pages):
            if k % 3 == 0:
                data = bytearray(path.read_bytes())
                data[HEADER.size + len(data) // 2 % 100] ^= 0x55
                path.write_bytes(bytes(data))
            elif k % 3 == 1:
                path.unlink()


class RedisStore:
    def __init__(self, server: RedisServer) -> None:
        import redis

        self.spec = server.url
        self.server = server
        self.client = redis.Redis.from_url(server.url)

    def damage(self) -> None:
        names = sorted(self.client.scan_iter(match=b"radixrt:kv:*", count=1000))
        assert len(names) >= 40
        for k, name in enumerate(names):
            if k % 3 == 0:
                data = bytearray(self.client.get(name))
                data[HEADER.size + len(data) // 2 % 100] ^= 0x55
                self.client.set(name, bytes(data))
            elif k % 3 == 1:
                self.client.delete(name)


@pytest.fixture(params=["dir", "redis"])
def store(request, tmp_path):
    if request.param == "dir":
        return DirStore(tmp_path)
    return RedisStore(request.getfixturevalue("redis_server"))


def test_restart_finds_earlier_prefixes(make_engine, store):
    batch = prompts()
    want, _ = run(make_engine(block_size=4), batch)
    first = make_engine(kv_storage=store.spec, **STORAGE)
    assert run(first, batch)[0] == want
    settle(first)
    s = first.stats()
    assert s["storage_written_pages"] >= len(batch) * 10 and s["storage_write_drops"] == 0
    first.core.shutdown()  # the runner finishes its storage writes

    again = make_engine(kv_storage=store.spec, **STORAGE)
    out, cached = run(again, batch)
    assert out == want
    # every full page of each prompt but its last token's came back from storage
    assert all(cached[i] == 40 for i in range(len(batch)))
    s = again.stats()
    assert s["storage_fetches"] == len(batch) and s["storage_fetched_pages"] == 40
    assert s["storage_hits"] == 40 and s["storage_prefetch_timeouts"] == 0
    assert s["host_loaded_blocks"] >= 40


@pytest.mark.parametrize("overlap", [False, True])
def test_a_finished_requests_pages_are_written_without_another_step(make_engine, tmp_path, overlap):
    """The engine may idle after the last request: its cache entry goes to storage anyway."""
    eng = make_engine(kv_storage=str(tmp_path), overlap_schedule=overlap, **STORAGE)
    run(eng, prompts(1), dataclasses.replace(GREEDY, max_tokens=1))
    settle(eng)
    assert eng.stats()["storage_written_pages"] == 10  # 41 prompt tokens and 1 output


def test_corrupt_or_deleted_pages_are_recomputed(make_engine, store):
    batch = prompts()
    want, _ = run(make_engine(block_size=4), batch)
    first = make_engine(kv_storage=store.spec, **STORAGE)
    run(first, batch)
    settle(first)
    first.core.shutdown()  # the runner finishes its storage writes
    store.damage()

    again = make_engine(kv_storage=store.spec, **STORAGE)
    out, _ = run(again, batch)
    assert out == want
    s = again.stats()
    assert s["storage_corrupt_pages"] > 0 and s["storage_misses"] > 0


def test_salts_share_no_page(make_engine, store):
    batch = prompts(2)
    first = make_engine(kv_storage=store.spec, **STORAGE)
    run(first, batch, options=RequestOptions(cache_salt="tenant-a"))
    settle(first)
    first.core.shutdown()  # the runner finishes its storage writes
    again = make_engine(kv_storage=store.spec, **STORAGE)
    _, cached = run(again, batch, options=RequestOptions(cache_salt="tenant-b"))
    assert cached == {0: 0, 1: 0}
    assert again.stats()["storage_hits"] == 0
    _, cached = run(again, batch, options=RequestOptions(cache_salt="tenant-a"))
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


def test_two_engines_share_one_store(make_engine, store):
    """Replicas on one store: each reuses the pages the other computed (both run at once)."""
    batch = prompts()
    want, _ = run(make_engine(block_size=4), batch)
    a = make_engine(kv_storage=store.spec, **STORAGE)
    b = make_engine(kv_storage=store.spec, **STORAGE)
    out, cached = run(a, batch[:2])
    assert cached == {0: 0, 1: 0}
    settle(a)
    out_b, cached_b = run(b, batch)
    assert out_b == want and out == {i: want[i] for i in range(2)}
    assert cached_b == {0: 40, 1: 40, 2: 0, 3: 0}
    settle(b)
    _, cached_a = run(a, batch[2:])
    assert cached_a == {0: 40, 1: 40}
    assert a.stats()["storage_hits"] == b.stats()["storage_hits"] == 20  # 10 pages a prompt


def test_redis_killed_mid_run_serves_on_and_reconnects(make_engine, redis_server):  # noqa: F811
    batch = prompts(6)
    want, _ = run(make_engine(block_size=4), batch)
    eng = make_engine(kv_storage=redis_server.url, **dict(STORAGE, num_kv_blocks=24))
    out, _ = run(eng, batch[:2])
    settle(eng)
    redis_server.stop()
    more, cached = run(eng, batch[2:4] + batch[:2])  # writes and fetches fail: all computed
    settle(eng)
    assert {i: more[i] for i in range(4)} == {0: want[2], 1: want[3], 2: want[0], 3: want[1]}
    assert out == {0: want[0], 1: want[1]}
    s = eng.stats()
    assert s["storage_errors"] > 0 and s["storage_hits"] == 0
    redis_server.start()  # empty: it kept nothing
    wait_until_up(eng)
    written = s["storage_written_pages"]
    last, _ = run(eng, batch[4:])
    settle(eng)
    assert last == {0: want[4], 1: want[5]}
    assert eng.stats()["storage_written_pages"] >= written + 20  # the store is used again


def wait_until_up(engine, timeout_s=40.0):
    backend = engine.core.runner.storage.backend
    deadline = time.monotonic() + timeout_s
    while backend.down and time.monotonic() < deadline:
        time.sleep(0.05)


def test_write_back_after_an_outage_serves_the_prefix_from_storage(
    make_engine,
    redis_server,  # noqa: F811
):
    """Pages whose write-through failed (Redis was down) are written when they leave the
    host tier: a prefix evicted from GPU and host memory is later found in storage."""
    batch, others = prompts(2), prompts(8)[2:]
    want, _ = run(make_engine(block_size=4), batch)
    small = dict(STORAGE, num_kv_blocks=24, num_host_kv_blocks=24)
    eng = make_engine(kv_storage=redis_server.url, **small)
    redis_server.stop()
    run(eng, batch)
    settle(eng)
    assert eng.stats()["storage_written_pages"] == 0
    redis_server.start()
    wait_until_up(eng)
    run(eng, others)  # 6 more prompts of 11 blocks: the batch leaves GPU and host memory
    settle(eng)
    s = eng.stats()
    assert s["storage_written_back_pages"] >= 20 and s["host_evicted_blocks"] > 0
    fresh = make_engine(kv_storage=redis_server.url, **STORAGE)
    out, cached = run(fresh, batch)
    assert out == want and cached == {0: 40, 1: 40}


def test_bench_storage_smoke(redis_server, capsys):  # noqa: F811
    """benchmarks/bench_storage.py on the tiny model: a warm run that loads computes only each
    chat's last partial page; one under the cost model computes no more than the cold run."""
    import json

    import torch

    from benchmarks.bench_storage import main

    threads = torch.get_num_threads()
    try:
        main(["--model", "tiny", "--history", "64", "--chats", "2", "--threads", "1",
              "--policies", "always,auto", "--drop-page-cache", "--disk-gib", "0.02",
              "--redis-url", redis_server.url])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["store"] for r in rows] == ["dir", "redis"]
    for r in rows:
        assert (r["computed_tokens_cold"], r["computed_tokens_always"]) == (128, 32)
        assert r["pages_read_always"] == 9  # 3 a chat and 3 of the warm-up prompt
        assert 32 <= r["computed_tokens_auto"] <= 128
    assert rows[0]["disk_read_gbps"] > 0 and "disk_read_gbps" not in rows[1]
