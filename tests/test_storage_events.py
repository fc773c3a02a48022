"""KV events of the storage tier with the tiny model on CPU (a local directory; Redis too for
the medium and the hashes): the event stream replayed into an empty index equals the
recorder's held blocks per medium after every step; pages are named by the same hashes (and
parents) as the GPU events name their blocks; the size bound's deletions, pages a fetch finds
missing, dropped writes and a restart on a warm store each do what
radixrt.cache.storage_events says."""

from __future__ import annotations

import dataclasses
import itertools

import msgspec
from redis_server import redis_server  # noqa: F401 (a fixture)
from test_kv_events import Index
from test_storage_engine import (
    GREEDY,
    STORAGE,
    DirStore,
    prompts,
    settle,
    store,  # noqa: F401 (a fixture: a directory, and Redis)
)
from test_storage_tier import IDENTITY

from radixrt.cache.kv_events import (
    MEDIUM_DISK,
    MEDIUM_EXTERNAL,
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from radixrt.cache.radix_events import RadixEventRecorder
from radixrt.cache.radix_storage import StorageRadixCache
from radixrt.cache.storage import HEADER, PageKeyer, PagesRemoved, PagesStored, StorageTier
from radixrt.cache.storage_backends import storage_medium
from radixrt.cache.storage_events import StorageEventRecorder
from radixrt.cache.tiers import HostTier
from radixrt.kv.allocator import BlockAllocator

EVENTS = dict(STORAGE, kv_events=True, kv_events_hash_seed="0")
MEDIUMS = ("GPU", "CPU", MEDIUM_DISK, MEDIUM_EXTERNAL)


class Stream:
    """What a router subscribed to `engine` sees: its events, replayed per medium."""

    def __init__(self, engine, medium: str = MEDIUM_DISK) -> None:
        self.engine = engine
        self.medium = medium  # the store's
        self.rids = itertools.count()
        self.index = Index(MEDIUMS)
        self.gpu: dict[int, int | None] = {}  # hash -> parent of every block stored on GPU
        self.disk_stored = 0  # blocks stored on the store's medium
        self.disk_removed = 0

    def step(self) -> list:
        """One engine step (also when idle: the storage results come back); checks the
        replay against the recorder."""
        deltas = self.engine.step()
        events = self.engine.core.take_kv_events()
        for e in events:
            if isinstance(e, BlockStored) and e.medium == "GPU":
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    self.gpu[h] = parent
                    parent = h
            if getattr(e, "medium", None) == self.medium:
                if isinstance(e, BlockStored):
                    self.disk_stored += len(e.block_hashes)
                else:
                    assert isinstance(e, BlockRemoved)
                    self.disk_removed += len(e.block_hashes)
        self.index.apply(msgspec.msgpack.encode(KVEventBatch(0.0, events, 0)))
        for medium in MEDIUMS:
            assert set(self.index.blocks[medium]) == self.engine.core.kv_events.held(medium)
        return deltas

    def run(self, batch, params=GREEDY) -> dict[int, int]:
        """Each prompt alone; cached prompt tokens by index. Ends with the writes landed and
        reported."""
        cached = {}
        for i, ids in enumerate(batch):
            self.engine.add_request(ids, params, rid=f"r{next(self.rids)}")
            while self.engine.core.has_work:
                for d, _ in self.step():
                    cached[i] = d.num_cached_tokens
        settle(self.engine)
        self.step()
        self.engine.check_integrity()
        return cached

    @property
    def disk(self) -> dict[int, int | None]:
        return self.index.blocks[self.medium]


def files(root) -> set[bytes]:
    """Keys of the pages in a local store."""
    return {bytes.fromhex(p.name.removesuffix(".kvpage")) for p in root.rglob("*.kvpage")}


def held_keys(engine) -> set[bytes]:
    return engine.core.cache.events.held()


def page_gb(make_engine, num_pages: int) -> float:
    """kv_storage_max_gb that holds `num_pages` pages of the tiny model at block size 4."""
    probe = make_engine(block_size=4, num_host_kv_blocks=4)
    return num_pages * (HEADER.size + probe.core.runner.host_pool.bytes_per_block) / 2**30


def test_written_pages_are_announced_with_the_gpu_hashes(make_engine, store):  # noqa: F811
    eng = make_engine(kv_storage=store.spec, **EVENTS)
    stream = Stream(eng, storage_medium(store.spec))
    stream.run(prompts())
    s = eng.stats()
    assert s["storage_write_drops"] == 0 and s["storage_written_pages"] == 44
    # every block the device cached was written, and is named as its GPU event named it
    assert stream.disk == stream.gpu and len(stream.disk) == 44
    if isinstance(store, DirStore):
        assert held_keys(eng) == files(store.root)
    else:
        names = store.client.scan_iter(match=b"radixrt:kv:*")
        assert held_keys(eng) == {
            bytes.fromhex(n.removeprefix(b"radixrt:kv:").decode()) for n in names
        }
    assert stream.disk_removed == 0


def test_the_size_bound_removes_pages(make_engine, tmp_path):
    eng = make_engine(
        kv_storage=str(tmp_path), kv_storage_max_gb=page_gb(make_engine, 15), **EVENTS
    )
    stream = Stream(eng)
    stream.run(prompts())
    assert eng.stats()["storage_evicted_pages"] == 44 - 15 == stream.disk_removed
    assert len(stream.disk) == 15 and held_keys(eng) == files(tmp_path)
    assert set(stream.disk.items()) <= set(stream.gpu.items())


def test_dropped_writes_announce_nothing(make_engine, tmp_path):
    eng = make_engine(kv_storage=str(tmp_path), kv_storage_write_pages=1, **EVENTS)
    stream = Stream(eng)
    stream.run(prompts())
    s = eng.stats()
    assert s["storage_write_drops"] > 0
    assert stream.disk_stored == s["storage_written_pages"] == len(files(tmp_path))
    assert held_keys(eng) == files(tmp_path) and set(stream.disk.items()) <= set(stream.gpu.items())


def test_a_fetch_that_misses_held_pages_removes_them(make_engine, tmp_path):
    """Pages deleted behind the engine's back (as a Redis server evicts): the fetch that
    misses them announces their removal."""
    batch = prompts(6, length=29)  # 7 pages each: the first prompts leave GPU and host memory
    small = dict(EVENTS, num_kv_blocks=24, num_host_kv_blocks=16)
    eng = make_engine(kv_storage=str(tmp_path), **small)
    stream = Stream(eng)
    stream.run(batch)
    assert len(stream.disk) == 6 * 7 + 6  # 7 prompt pages and 1 output page each
    for path in tmp_path.rglob("*.kvpage"):
        path.unlink()
    stream.run(batch[:1], dataclasses.replace(GREEDY, max_tokens=1))
    # the fetch missed all 7 pages of the prompt (it had left GPU and host): removed, then
    # written again; the other prompts' deleted pages stay announced (no fetch saw them go)
    assert stream.disk_removed == 7 and len(stream.disk) == 48
    assert len(files(tmp_path)) == 7 and files(tmp_path) <= held_keys(eng)


def test_a_restart_announces_stored_pages_only_when_a_fetch_finds_them(make_engine, tmp_path):
    first = make_engine(kv_storage=str(tmp_path), **EVENTS)
    before = Stream(first)
    before.run(prompts())
    first.core.shutdown()

    # bounded below what is stored: writing evicts pages this engine never announced
    again = make_engine(
        kv_storage=str(tmp_path), kv_storage_max_gb=page_gb(make_engine, 50), **EVENTS
    )
    stream = Stream(again)
    stream.step()
    assert stream.disk == {}  # a warm store is not announced at start
    cached = stream.run(prompts(1))  # prompt 0 again: its 10 pages come from storage
    assert cached == {0: 40}
    # the 10 found and the page of its last prompt token and outputs (written as before)
    assert len(stream.disk) == 11 and set(stream.disk.items()) <= set(before.disk.items())
    stream.run([[7 + i % 50 for i in range(41)]])  # 11 new pages: 5 old ones go unannounced
    assert again.stats()["storage_evicted_pages"] == 5 and stream.disk_removed == 0
    assert len(stream.disk) == 22 and held_keys(again) <= files(tmp_path)


# ---- plain Python: the recorder between the tree and the runner's reports ----
def make_cache(max_held: int):
    recorder = RadixEventRecorder(BlockHasher(4, seed="0"))
    tier = StorageTier(PageKeyer(IDENTITY, 4), prefetch_timeout_s=1.0)
    alloc = BlockAllocator(32)
    events = StorageEventRecorder(recorder, MEDIUM_DISK, max_pending=48, max_held=max_held)
    return StorageRadixCache(alloc, 4, HostTier(16), tier, recorder, events), recorder


def replay(recorder: RadixEventRecorder, index: Index) -> list:
    events = recorder.take()
    index.apply(msgspec.msgpack.encode(KVEventBatch(0.0, events, 0)))
    for medium in MEDIUMS:
        assert set(index.blocks[medium]) == recorder.held(medium)
    return events


def test_held_pages_are_bounded_and_a_reset_keeps_them():
    cache, recorder = make_cache(max_held=3)
    index = Index(MEDIUMS)
    tokens = list(range(100, 118))  # 4 full pages
    blocks = cache.allocator.allocate(5)
    cache.insert(tokens, blocks)
    cache.allocator.decref(blocks)
    keys = [op.key for op in cache.storage.take_ops()]
    replay(recorder, index)
    assert index.blocks[MEDIUM_DISK] == {}  # queued is not stored
    cache.finish_storage_io([PagesStored(tuple(keys[:2])), PagesStored(tuple(keys[2:]))])
    events = replay(recorder, index)
    # two runs of one chain, then the oldest page goes past the bound
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved]
    assert events[1].parent_block_hash == events[0].block_hashes[-1]
    assert index.blocks[MEDIUM_DISK] == {h: p for h, p in stored_chain(events)[1:]}
    cache.finish_storage_io([PagesRemoved((keys[0], keys[3]))])  # keys[0] is forgotten already
    assert len(replay(recorder, index)[0].block_hashes) == 1
    cache.reset()  # the tree empties; the store does not: no AllBlocksCleared
    events = replay(recorder, index)
    assert not any(isinstance(e, AllBlocksCleared) for e in events)
    assert len(index.blocks[MEDIUM_DISK]) == 2 and index.blocks["GPU"] == {}
    cache.check_integrity()


def stored_chain(events) -> list[tuple[int, int | None]]:
    """(hash, parent) of the blocks the BlockStored `events` name, in order."""
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            parent = e.parent_block_hash
            for h in e.block_hashes:
                out.append((h, parent))
                parent = h
    return out


def test_mediums_name_the_store():
    assert storage_medium("/var/kv") == MEDIUM_DISK == "DISK"
    assert storage_medium("redis://host:6379/0") == MEDIUM_EXTERNAL == "EXTERNAL"
