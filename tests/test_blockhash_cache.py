"""BlockHashCache (vLLM automatic prefix caching semantics): unit tests and a randomized
simulated scheduler checked after every operation against a naive model keyed by exact
token prefixes, the allocator's reference counts and simulated KV contents."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from naive_prefix_cache import NaiveBlockHashCache

from radixrt.cache import create_prefix_cache
from radixrt.cache.blockhash import BlockHashCache
from radixrt.kv.allocator import BlockAllocator

BLOCK_SIZES = [1, 4, 16]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def finished_request(cache: BlockHashCache, tokens: list[int]) -> list[int]:
    """A request that computed `tokens` in fresh blocks, cached them and finished."""
    blocks = cache.allocator.allocate(ceil_div(len(tokens), cache.block_size))
    res = cache.insert(tokens, blocks)
    cache.lock(res.handle)
    cache.unlock(res.handle)
    cache.allocator.decref(blocks)
    return blocks


# ---- unit tests ---------------------------------------------------------------------


def test_factory_and_bad_block_size():
    alloc = BlockAllocator(4)
    assert isinstance(create_prefix_cache("blockhash", alloc, 4), BlockHashCache)
    with pytest.raises(ValueError, match="power of two"):
        BlockHashCache(alloc, 6)


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_only_full_blocks_are_cached_and_matched(bs):
    alloc = BlockAllocator(16)
    cache = BlockHashCache(alloc, bs)
    tokens = [t % 3 for t in range(2 * bs + bs // 2 + 1)]
    blocks = finished_request(cache, tokens)
    assert cache.cached_blocks == len(tokens) // bs
    assert cache.held_refs() == Counter(blocks[: len(tokens) // bs])
    m = cache.match(tokens + [7])
    assert m.num_cached_tokens == (len(tokens) // bs) * bs and m.num_cached_tokens % bs == 0
    assert m.blocks == blocks[: len(tokens) // bs] and m.handle == tuple(m.blocks)
    m = cache.match(tokens[: bs + bs // 2])  # ends inside block 1: only block 0 matches
    assert m.num_cached_tokens == bs and m.blocks == blocks[:1]
    # match counts nothing (the scheduler records one lookup per admitted prompt)
    assert cache.stats.num_hit_tokens == cache.stats.num_queried_tokens == 0
    cache.check_integrity()
    alloc.check_integrity(cache.held_refs())


def test_hash_chain_needs_the_same_prefix():
    alloc = BlockAllocator(16)
    cache = BlockHashCache(alloc, 4)
    b0, b1 = finished_request(cache, [1, 1, 1, 1, 2, 2, 2, 2])
    assert cache.match([2, 2, 2, 2]).num_cached_tokens == 0  # same content, other position
    assert cache.match([3, 3, 3, 3, 2, 2, 2, 2]).num_cached_tokens == 0  # other prefix
    assert cache.match([1, 1, 1, 1, 3, 3, 3, 3]).blocks == [b0]
    assert cache.match([1, 1, 1, 1, 2, 2, 2, 2]).blocks == [b0, b1]


def test_no_deduplication():
    alloc = BlockAllocator(16)
    cache = BlockHashCache(alloc, 4)
    a = finished_request(cache, [1, 2, 3, 4, 5])
    mine = alloc.allocate(2)  # a request that computed the same tokens concurrently
    res = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], mine)
    assert res.num_new_tokens == 4 and res.handle == (a[0], mine[1])
    assert cache.held_refs() == Counter([a[0], mine[1]])
    assert alloc.ref_counts[mine[0]] == 1  # not cached: the request alone holds it
    alloc.decref(mine)
    cache.check_integrity()
    alloc.check_integrity(cache.held_refs())


def test_lru_eviction_order_later_blocks_of_a_chain_first():
    alloc = BlockAllocator(8)
    cache = BlockHashCache(alloc, 1)
    a = finished_request(cache, [1, 2, 3])
    b = finished_request(cache, [4, 5])
    freed_order = []
    for _ in range(5):
        before = {x for x in a + b if alloc.ref_counts[x]}
        assert cache.evict(1) == 1
        freed_order += [x for x in before if not alloc.ref_counts[x]]
    assert freed_order == [a[2], a[1], a[0], b[1], b[0]]
    assert cache.stats.num_evicted_blocks == 5 and cache.cached_blocks == 0


def test_match_refreshes_lru():
    alloc = BlockAllocator(8)
    cache = BlockHashCache(alloc, 2)
    a = finished_request(cache, [1, 1, 2, 2])
    b = finished_request(cache, [3, 3])
    cache.match([1, 1])  # a[0] is now the most recent; a[1] stays the oldest
    assert cache.evict(1) == 1 and alloc.ref_counts[a[1]] == 0
    assert cache.evict(1) == 1 and alloc.ref_counts[b[0]] == 0
    assert cache.evict(1) == 1 and alloc.ref_counts[a[0]] == 0
    assert cache.evict(1) == 0
    cache.check_integrity()


def test_blocks_in_use_are_not_evicted():
    alloc = BlockAllocator(8)
    cache = BlockHashCache(alloc, 2)
    a = finished_request(cache, [1, 1, 2, 2])
    b = finished_request(cache, [3, 3, 4, 4])
    c = finished_request(cache, [5, 5])
    m = cache.match([1, 1, 2, 2])  # a request uses a: lock + its own references
    cache.lock(m.handle)
    alloc.incref(m.blocks)
    alloc.incref(b[:1])  # a holder that did not lock: still not evictable
    assert cache.evictable_blocks == 3
    assert cache.evict(10) == 2
    assert alloc.ref_counts[b[1]] == 0 and alloc.ref_counts[c[0]] == 0
    assert cache.cached_blocks == 3 and alloc.ref_counts[b[0]] == 2
    assert cache.match([1, 1, 2, 2]).blocks == a
    cache.unlock(m.handle)
    alloc.decref(m.blocks)
    assert cache.evict(10) == 2  # a's blocks; b[0] is skipped and stays cached
    assert cache.held_refs() == Counter(b[:1])
    alloc.decref(b[:1])
    assert cache.evict(10) == 1
    assert alloc.num_free == 8 and cache.cached_blocks == 0
    cache.check_integrity()


def test_reset_drops_every_unlocked_entry():
    alloc = BlockAllocator(8)
    cache = BlockHashCache(alloc, 2)
    finished_request(cache, [1, 1, 2, 2])
    m = cache.match([1, 1])
    cache.lock(m.handle)
    cache.reset()
    assert cache.cached_blocks == 1 and cache.evictable_blocks == 0
    cache.unlock(m.handle)
    cache.reset()
    assert cache.cached_blocks == 0 and alloc.num_free == 8
    cache.check_integrity()
    with pytest.raises(ValueError):
        cache.evict(-1)


# ---- simulated scheduler ------------------------------------------------------------


def prefix_hashes(tokens: list[int]) -> list[int]:
    h, out = 0, []
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


@dataclass
class SimRequest:
    tokens: list[int]
    hashes: list[int]
    handle: tuple[int, ...]  # locked
    computed: int
    table: list[int] = field(default_factory=list)  # one reference held per entry


class BlockHashSim:
    def __init__(self, block_size: int, num_blocks: int, alphabet: int, max_len: int, seed: int):
        self.rng = random.Random(seed)
        self.bs, self.alphabet, self.max_len = block_size, alphabet, max_len
        self.max_live = 2 + seed % 4
        self.alloc = BlockAllocator(num_blocks)
        self.cache = BlockHashCache(self.alloc, block_size)
        self.naive = NaiveBlockHashCache(block_size)
        self.kv: dict[int, list[int | None]] = {}
        self.live: list[SimRequest] = []
        self.history: list[list[int]] = []
        self.num_evictions = 0

    def random_tokens(self) -> list[int]:
        rng = self.rng
        tokens = []
        if self.history and rng.random() < 0.85:
            base = rng.choice(self.history)
            tokens = base[: max(rng.randint(0, len(base)), rng.randint(0, len(base)))]
        tail = rng.randint(0 if tokens else 1, max(1, self.max_len - len(tokens)))
        return (tokens + [rng.randrange(self.alphabet) for _ in range(tail)])[: self.max_len]

    def evict(self, n: int) -> None:
        before = set(self.cache.held_refs())
        free_before, evictable = self.alloc.num_free, self.cache.evictable_blocks
        freed = self.cache.evict(n)
        self.num_evictions += 1
        assert self.alloc.num_free - free_before == freed <= evictable
        assert freed >= n or self.cache.evictable_blocks == 0
        self.sync_naive(before)

    def sync_naive(self, before: set[int]) -> None:
        after = set(self.cache.held_refs())
        assert after <= before, "eviction cached something new"
        self.naive.restrict_to_blocks(after)
        for req in self.live:
            assert set(req.handle) <= after, "a locked block was evicted"

    def allocate(self, n: int) -> list[int] | None:
        if n > self.alloc.num_free:
            self.evict(n - self.alloc.num_free)
        if n > self.alloc.num_free:
            return None
        blocks = self.alloc.allocate(n)
        for b in blocks:
            self.kv[b] = [None] * self.bs
        return blocks

    def match(self, tokens: list[int]):
        m = self.cache.match(tokens)
        assert (m.num_cached_tokens, m.blocks) == self.naive.match(tokens)
        hashes = prefix_hashes(tokens)
        for p in range(m.num_cached_tokens):
            assert self.kv[m.blocks[p // self.bs]][p % self.bs] == hashes[p]
        return m

    def start(self) -> list[int]:
        tokens = self.random_tokens()
        m = self.match(tokens)
        self.cache.lock(m.handle)
        req = SimRequest(tokens, prefix_hashes(tokens), m.handle, m.num_cached_tokens, m.blocks)
        self.alloc.incref(req.table)
        self.live.append(req)
        return tokens

    def advance(self, req: SimRequest) -> None:
        end = min(len(req.tokens), req.computed + self.rng.randint(1, 2 * self.bs + 3))
        got = self.allocate(ceil_div(end, self.bs) - len(req.table))
        if got is None:
            return self.release(req)
        req.table += got
        for p in range(req.computed, end):
            row = self.kv[req.table[p // self.bs]]
            assert row[p % self.bs] is None
            row[p % self.bs] = req.hashes[p]
        req.computed = end

    def insert(self, req: SimRequest, finish: bool) -> None:
        tokens = req.tokens[: req.computed]
        res = self.cache.insert(tokens, req.table)
        assert res.num_new_tokens == self.naive.insert(tokens, req.table)
        bs = self.bs
        assert res.handle == tuple(
            self.naive.cached[tuple(tokens[: (i + 1) * bs])] for i in range(len(tokens) // bs)
        )
        self.cache.lock(res.handle)
        self.cache.unlock(req.handle)
        req.handle = res.handle
        if finish:
            self.release(req)

    def release(self, req: SimRequest) -> None:
        self.cache.unlock(req.handle)
        self.alloc.decref(req.table)
        self.live.remove(req)

    def step(self) -> None:
        rng, r = self.rng, self.rng.random()
        if not self.live or (r < 0.2 and len(self.live) < self.max_live):
            self.history = [*self.history[-29:], self.start()]
        elif r < 0.55:
            self.advance(rng.choice(self.live))
        elif r < 0.65:
            self.insert(rng.choice(self.live), finish=False)
        elif r < 0.8:
            self.insert(rng.choice(self.live), finish=True)
        elif r < 0.82:
            self.release(rng.choice(self.live))
        elif r < 0.92:
            self.match(self.random_tokens())
        elif r < 0.995:
            self.evict(rng.randint(1, 4))
        else:
            before = set(self.cache.held_refs())
            self.cache.reset()
            self.sync_naive(before)

    def check(self) -> None:
        cache, alloc, bs = self.cache, self.alloc, self.bs
        expected = cache.held_refs()
        for req in self.live:
            expected.update(req.table)
        alloc.check_integrity(expected)
        cache.check_integrity()
        cached = set(cache.held_refs())
        assert cache.cached_blocks == len(cached) == len(self.naive.cached)
        assert set(self.naive.cached.values()) == cached
        locked = {b for req in self.live for b in req.handle}
        exact = sum(1 for b in cached if alloc.ref_counts[b] == 1 and b not in locked)
        assert cache.evictable_blocks == exact
        for prefix, b in self.naive.cached.items():
            assert self.kv[b] == prefix_hashes(list(prefix))[-bs:]


SIM_CASES = [
    # (block_size, num_blocks, alphabet, max_len, seed, steps)
    (1, 48, 2, 40, 0, 2000),
    (1, 64, 3, 40, 1, 2000),
    (4, 32, 2, 48, 2, 2000),
    (4, 24, 3, 40, 3, 2000),
    (16, 16, 2, 80, 4, 2000),
    (16, 32, 2, 128, 5, 2000),
]


@pytest.mark.parametrize("block_size,num_blocks,alphabet,max_len,seed,steps", SIM_CASES)
def test_simulated_scheduler(block_size, num_blocks, alphabet, max_len, seed, steps):
    sim = BlockHashSim(block_size, num_blocks, alphabet, max_len, seed)
    t0 = time.perf_counter()
    for _ in range(steps):
        sim.step()
        sim.check()
    assert sim.cache.stats.num_inserted_tokens > 0
    for req in list(sim.live):
        sim.insert(req, finish=True)
        sim.check()
    before = set(sim.cache.held_refs())
    sim.cache.reset()
    sim.sync_naive(before)
    sim.check()
    assert sim.cache.cached_blocks == 0 and sim.alloc.num_free == num_blocks
    assert sim.num_evictions > 10, "workload too small to exercise eviction"
    assert time.perf_counter() - t0 < 30
