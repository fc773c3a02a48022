"""The storage layer of the radix tree (plain Python) and the runner side's bounded writes."""

from __future__ import annotations

import threading
import time

import torch

from radixrt.cache.kv_events import BlockHasher
from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.cache.radix_events import RadixEventRecorder
from radixrt.cache.radix_storage import StorageRadixCache
from radixrt.cache.storage import (
    FetchDone,
    FetchPages,
    PageKeyer,
    PagesRemoved,
    StorageIdentity,
    StorageStats,
    StorageTier,
    StorageUnavailable,
    StoreHostPage,
    StorePage,
)
from radixrt.cache.tiers import HostTier
from radixrt.executor.storage_io import StorageIO
from radixrt.kv.allocator import BlockAllocator
from radixrt.kv.host_pool import HostKVPool
from radixrt.kv.pool import KVPool

BS = 4
IDENTITY = StorageIdentity("tiny", "r", "float32", "", "page-first")


def make_cache(num_blocks=32, num_host=16, events=True):
    recorder = RadixEventRecorder(BlockHasher(BS, seed="t")) if events else None
    tier = StorageTier(PageKeyer(IDENTITY, BS), prefetch_timeout_s=1.0)
    cache = StorageRadixCache(BlockAllocator(num_blocks), BS, HostTier(num_host), tier, recorder)
    return cache, tier


def insert(cache, tokens, namespace=DEFAULT_NAMESPACE):
    blocks = cache.allocator.allocate(-(-len(tokens) // BS))
    result = cache.insert(tokens, blocks, namespace)
    cache.allocator.decref(blocks)  # the request's references; the tree keeps its own
    return result


def test_write_through_stores_new_full_pages_once():
    cache, tier = make_cache()
    tokens = list(range(100, 114))  # 3 full pages and 2 tokens
    insert(cache, tokens[:6])
    insert(cache, tokens)
    ops = tier.take_ops()
    keys = tier.keyer.keys(tokens, DEFAULT_NAMESPACE)
    assert [op.key for op in ops] == keys  # page 1 ends on the second leaf's edge
    assert all(isinstance(op, StorePage) for op in ops)
    assert len({op.device_block for op in ops}) == 3
    insert(cache, tokens)  # cached already: nothing new to write
    assert tier.take_ops() == []
    cache.check_integrity()


def test_host_eviction_writes_back_the_leaving_pages():
    cache, tier = make_cache(num_blocks=8, num_host=4)
    a, b = list(range(100, 114)), list(range(200, 214))  # 3 full pages and 2 tokens each
    insert(cache, a)
    cache.evict(4)  # to the host; a host copy of a device entry loses nothing when it goes
    assert cache.match(a).num_host_tokens == 14
    insert(cache, b)
    tier.take_ops()
    host_a = cache.match(a).handle.host_blocks
    cache.evict(4)  # b needs the host: a leaves the tree, its full pages go to storage
    assert cache.match(a).num_cached_tokens == 0
    ops = tier.take_ops()
    assert ops == [
        StoreHostPage(h, k) for h, k in zip(host_a, tier.keyer.keys(a, DEFAULT_NAMESPACE))
    ]
    assert tier.stats.pages_evicted == 3
    cache.check_integrity()


def test_fetch_enters_the_tree_past_the_match():
    cache, tier = make_cache()
    tokens = list(range(200, 221))
    insert(cache, tokens[:6])  # cached up to position 6, inside page 1
    tier.take_ops()  # its write-through
    ticket = cache.begin_fetch(tokens[:20], DEFAULT_NAMESPACE, 6)
    (op,) = tier.take_ops()
    assert isinstance(op, FetchPages) and op.keys == tuple(
        tier.keyer.keys(tokens[:20], DEFAULT_NAMESPACE)[1:]
    )
    assert len(op.host_blocks) == 4 and cache.fetching(ticket)
    cache.check_integrity()  # the fetch's host blocks are held outside the tree
    assert cache.finish_fetch(FetchDone(ticket, 3)) == 3  # pages 1..3 stored, page 4 not
    assert not cache.fetching(ticket)
    m = cache.match(tokens[:20])
    assert m.num_cached_tokens == 16 and m.num_host_tokens == 10
    assert cache.host.allocator.num_free == 16 - 3
    cache.check_integrity()  # KV events too: the leaf is held on the host only


def test_fetch_that_found_nothing_new_frees_its_blocks():
    cache, tier = make_cache()
    tokens = list(range(300, 317))
    ticket = cache.begin_fetch(tokens, CacheNamespace("a"), 0)
    insert(cache, tokens, CacheNamespace("a"))  # computed meanwhile
    assert cache.finish_fetch(FetchDone(ticket, 4)) == 0
    empty = cache.begin_fetch(tokens, DEFAULT_NAMESPACE, 0)
    assert cache.finish_fetch(FetchDone(empty, 0)) == 0
    assert cache.host.allocator.num_free == 16 and len(cache.roots) == 2
    cache.check_integrity()


class SlowBackend:
    """Holds its first write until released."""

    def __init__(self, page_bytes):
        self.page_bytes = page_bytes
        self.release = threading.Event()
        self.written = []

    def exists(self, keys):
        return [k in self.written for k in keys]

    def get(self, keys, buffers):
        return [False for _ in keys]

    def set(self, keys, buffers):
        self.release.wait(30)
        self.written += keys
        return []

    def delete(self, keys):
        pass

    def stats(self):
        return StorageStats(num_pages=len(self.written))

    def close(self):
        pass


class DownOnceBackend:
    """Its first write fails as if the store were down; keeps what it is given after."""

    def __init__(self, page_bytes):
        self.page_bytes = page_bytes
        self.pages = {}
        self.down = True

    def exists(self, keys):
        return [k in self.pages for k in keys]

    def get(self, keys, buffers):
        return [False for _ in keys]

    def set(self, keys, buffers):
        if self.down:
            self.down = False
            raise StorageUnavailable("down")
        for k, b in zip(keys, buffers):
            self.pages[k] = bytes(b)
        return []

    def delete(self, keys):
        pass

    def stats(self):
        return StorageStats(num_pages=len(self.pages))

    def close(self):
        pass


def test_write_back_writes_only_pages_whose_write_through_failed():
    pool = KVPool(2, 8, BS, 1, 4, torch.float32, "cpu")
    host = HostKVPool(4, pool)
    for h in range(4):
        host.kv[h].fill_(float(h + 1))
    backend = DownOnceBackend(host.bytes_per_block)
    io = StorageIO(backend, host, staging_pages=4)
    keys = [bytes([i]) * 32 for i in range(4)]
    io.exchange([StorePage(1, keys[0]), StorePage(2, keys[1])])  # fails: the store is down
    io.drain()
    io.exchange([StorePage(3, keys[2])])  # lands
    io.drain()
    assert set(backend.pages) == {keys[2]}
    # all three leave the host tier (in host blocks 0, 1, 2): two were never written
    io.exchange([StoreHostPage(h, k) for h, k in zip(range(3), keys[:3])])
    io.drain()
    assert set(backend.pages) == set(keys[:3])
    for h in range(2):
        assert backend.pages[keys[h]] == host.kv[h].numpy().tobytes()
    s = io.stats()
    assert (s.write_errors, s.pages_written_back, s.write_drops) == (2, 2, 0)
    io.exchange([StoreHostPage(0, keys[0])])  # written now: not again
    io.close()
    assert io.stats().pages_written_back == 2


def test_writes_beyond_the_staging_pages_are_dropped_and_counted():
    pool = KVPool(2, 8, BS, 1, 4, torch.float32, "cpu")
    host = HostKVPool(4, pool)
    backend = SlowBackend(host.bytes_per_block)
    io = StorageIO(backend, host, staging_pages=2)
    keys = [bytes([i]) * 32 for i in range(5)]
    io.exchange([StorePage(1, keys[0])])  # taken by the thread, which waits
    io.exchange([StorePage(b, k) for b, k in zip([2, 3, 4], keys[1:4])])  # 1 staging page left
    s = io.stats()
    assert (s.pages_queued, s.write_drops) == (2, 2)
    backend.release.set()
    io.close()
    assert backend.written == keys[:2]


class SlowReadBackend(DownOnceBackend):
    def exists(self, keys):
        time.sleep(0.2)
        return [False for _ in keys]


def test_wait_for_fetch_returns_when_the_fetch_ends():
    pool = KVPool(2, 8, BS, 1, 4, torch.float32, "cpu")
    host = HostKVPool(4, pool)
    io = StorageIO(SlowReadBackend(host.bytes_per_block), host, staging_pages=2)
    t0 = time.monotonic()
    io.wait_for_fetch(5.0)  # nothing in flight: at once
    assert time.monotonic() - t0 < 1.0
    assert io.exchange([FetchPages(7, (bytes(32),), (0,))]) == []
    io.wait_for_fetch(5.0)  # it starts at the next exchange (after this step's swap copies)
    assert time.monotonic() - t0 < 1.0
    assert io.exchange([]) == []
    io.wait_for_fetch(5.0)
    assert 0.15 < time.monotonic() - t0 < 4.0
    assert io.exchange([]) == [PagesRemoved((bytes(32),)), FetchDone(7, 0)]
    io.close()
