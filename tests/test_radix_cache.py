"""RadixCache: unit tests, a hypothesis test against the naive model, and a randomized
simulated scheduler (interleaved requests, copy-on-write, eviction) checked after every
operation against the naive reference model, the allocator's reference counts and the
simulated KV contents."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from naive_prefix_cache import NaivePrefixCache
from radix_helpers import block_at, format_tree

from radixrt.cache import CacheNamespace, create_prefix_cache
from radixrt.cache.radix import RadixCache, RadixNode
from radixrt.cache.radix_node import NoObserver
from radixrt.kv.allocator import BlockAllocator

BLOCK_SIZES = [1, 4, 16]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def cache_tokens(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Insert `tokens` the way a finished request would: own blocks, insert, release."""
    blocks = cache.allocator.allocate(ceil_div(len(tokens), cache.block_size))
    cache.insert(tokens, blocks)
    cache.allocator.decref(blocks)
    return blocks


def tree_paths(cache: RadixCache) -> list[tuple[tuple[int, ...], list[int]]]:
    """Root-to-leaf paths as (tokens, per-token block)."""
    bs, out = cache.block_size, []
    stack: list[tuple[RadixNode, tuple[int, ...], list[int]]] = [(cache.root, (), [])]
    while stack:
        node, toks, per_token = stack.pop()
        if node is not cache.root:
            toks = toks + tuple(node.key)
            per_token = per_token + [block_at(node, p, bs) for p in range(node.start, node.end)]
            if not node.children:
                out.append((toks, per_token))
        stack.extend((child, toks, per_token) for child in node.children.values())
    return out


def unlocked_refs(cache: RadixCache) -> Counter[int]:
    refs: Counter[int] = Counter()
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        if node.lock_ref == 0:
            refs.update(node.blocks)
        stack.extend(node.children.values())
    return refs


# ---- unit tests ---------------------------------------------------------------------


def test_factory_and_bad_block_size():
    alloc = BlockAllocator(4)
    assert isinstance(create_prefix_cache("radix", alloc, 4), RadixCache)
    with pytest.raises(ValueError, match="power of two"):
        RadixCache(alloc, 3)


def test_empty_match_returns_root():
    cache = RadixCache(BlockAllocator(4), 4)
    m = cache.match([1, 2, 3])
    assert m.blocks == [] and m.num_cached_tokens == 0 and m.handle is cache.root
    assert cache.match([]).handle is cache.root
    cache.lock(m.handle)
    cache.unlock(m.handle)
    cache.check_integrity()


def test_insert_match_and_stats():
    alloc = BlockAllocator(16)
    cache = RadixCache(alloc, 4)
    blocks = cache_tokens(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match([1, 2, 3, 4, 5, 6, 7])
    assert m.num_cached_tokens == 6 and m.blocks == blocks
    # match counts nothing: the scheduler records one lookup per admitted prompt
    assert cache.stats.num_queried_tokens == 0 and cache.stats.num_hit_tokens == 0
    cache.stats.record_lookup(7, m.num_cached_tokens)
    assert cache.stats.num_queried_tokens == 7 and cache.stats.num_hit_tokens == 6
    assert cache.stats.num_inserted_tokens == 6
    assert cache.total_tokens == 6 and cache.cached_blocks == 2 and cache.evictable_blocks == 2
    alloc.check_integrity(cache.held_refs())
    cache.check_integrity()


def test_split_mid_block_shares_block_with_two_references():
    alloc = BlockAllocator(16)
    cache = RadixCache(alloc, 4)
    a0, a1 = cache_tokens(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match([1, 2, 3, 4, 5, 9])  # ends inside a1's range and inside the edge
    assert m.num_cached_tokens == 5 and m.blocks == [a0, a1]
    assert m.handle.end == 5
    assert cache.held_refs() == Counter({a0: 1, a1: 2})
    assert alloc.ref_counts[a1] == 2
    # A split on a block boundary adds no reference.
    m = cache.match([1, 2, 3, 4, 7])
    assert m.handle.end == 4 and cache.held_refs() == Counter({a0: 1, a1: 2})
    cache.check_integrity()
    alloc.check_integrity(cache.held_refs())


def test_block_table_uses_the_block_of_the_last_matched_token():
    """Two branches diverging mid-block live in different blocks for that block index."""
    alloc = BlockAllocator(16)
    cache = RadixCache(alloc, 4)
    a0, a1 = cache_tokens(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match([1, 2, 3, 4, 5, 9, 9])
    assert m.num_cached_tokens == 5
    cache.lock(m.handle)
    (b1,) = alloc.allocate(1)  # copy-on-write of a1's first token, then write 9, 9
    alloc.incref([a0])
    res = cache.insert([1, 2, 3, 4, 5, 9, 9], [a0, b1])
    assert res.num_new_tokens == 2 and res.handle.end == 7
    cache.lock(res.handle)
    cache.unlock(m.handle)
    assert cache.match([1, 2, 3, 4, 5, 9]).blocks == [a0, b1]
    assert cache.match([1, 2, 3, 4, 5]).blocks == [a0, a1]
    assert cache.match([1, 2, 3, 4, 5, 6]).blocks == [a0, a1]
    assert cache.match([1, 2, 3, 4]).blocks == [a0]
    # The match of [.., 5, 9] split [9, 9] inside b1's range: b1 is recorded twice too.
    assert cache.held_refs() == Counter({a0: 1, a1: 2, b1: 2})
    cache.unlock(res.handle)
    alloc.decref([a0, b1])
    cache.check_integrity()
    alloc.check_integrity(cache.held_refs())


def test_insert_keeps_existing_blocks_and_returns_split_handle():
    alloc = BlockAllocator(16)
    cache = RadixCache(alloc, 4)
    a = cache_tokens(cache, [1, 2, 3, 4, 5, 6])
    dup = alloc.allocate(2)
    res = cache.insert([1, 2, 3, 4, 5], dup)
    assert res.num_new_tokens == 0 and res.handle.end == 5
    assert cache.match([1, 2, 3, 4, 5, 6]).blocks == a
    assert alloc.decref(dup) == 2  # the tree took no reference on the duplicates
    assert cache.insert([], []).handle is cache.root
    with pytest.raises(AssertionError):
        cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], a)
    cache.check_integrity()


def test_lru_eviction_order_and_touch():
    alloc = BlockAllocator(3)
    cache = RadixCache(alloc, 4)
    (x,) = cache_tokens(cache, [1, 1])
    (y,) = cache_tokens(cache, [2, 2])
    (z,) = cache_tokens(cache, [3, 3])
    cache.match([1, 1])  # x is now the most recently used
    assert cache.evict(1) == 1 and alloc.ref_counts[y] == 0
    assert cache.evict(1) == 1 and alloc.ref_counts[z] == 0
    assert alloc.ref_counts[x] == 1
    assert cache.evict(5) == 1 and alloc.num_free == 3
    assert cache.stats.num_evicted_blocks == 3 and cache.total_tokens == 0
    cache.check_integrity()


def test_parent_becomes_evictable_after_its_child():
    alloc = BlockAllocator(4)
    cache = RadixCache(alloc, 4)
    cache_tokens(cache, [1, 2, 3, 4])
    cache_tokens(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.evictable_blocks == 2
    assert cache.evict(1) == 1 and cache.total_tokens == 4
    cache.check_integrity()
    assert cache.evict(1) == 1 and cache.total_tokens == 0
    cache.check_integrity()


def test_locked_path_is_not_evicted():
    alloc = BlockAllocator(8)
    cache = RadixCache(alloc, 4)
    a = cache_tokens(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    cache_tokens(cache, [9, 9, 9])
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 8])
    cache.lock(m.handle)
    assert cache.evictable_blocks == 1
    assert cache.evict(10) == 1
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]).blocks == a
    cache.reset()
    assert cache.total_tokens == 8
    cache.unlock(m.handle)
    assert cache.evictable_blocks == 2
    cache.reset()
    assert cache.total_tokens == 0 and alloc.num_free == 8
    cache.check_integrity()


def test_evicting_a_leaf_that_shares_a_locked_block_frees_nothing():
    alloc = BlockAllocator(4)
    cache = RadixCache(alloc, 4)
    a0, a1 = cache_tokens(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match([1, 2, 3, 4, 5])
    cache.lock(m.handle)
    assert cache.evictable_blocks == 0
    assert cache.evict(1) == 0  # removes the leaf [6]; a1 is still recorded by [1..5]
    assert cache.total_tokens == 5 and cache.held_refs() == Counter({a0: 1, a1: 1})
    cache.unlock(m.handle)
    assert cache.evictable_blocks == 2 and cache.evict(2) == 2
    cache.check_integrity()
    alloc.check_integrity(cache.held_refs())


def test_evict_stops_when_enough_blocks_are_free():
    alloc = BlockAllocator(8)
    cache = RadixCache(alloc, 1)
    for t in range(4):
        cache_tokens(cache, [t, t])
    # LRU first: leaf [0, 0] goes whole (2 blocks), then [1, 1] loses only its tail block.
    assert cache.evict(3) == 3
    assert cache.total_tokens == 5
    assert cache.match([0, 0]).num_cached_tokens == 0
    assert cache.match([1, 1]).num_cached_tokens == 1
    cache.check_integrity()
    alloc.check_integrity(cache.held_refs())
    with pytest.raises(ValueError):
        cache.evict(-1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_evict_trims_the_tail_of_a_long_leaf(block_size):
    """Evicting n blocks from a long LRU leaf keeps its head: block-aligned, exact."""
    alloc = BlockAllocator(64)
    cache = RadixCache(alloc, block_size)
    tokens = list(range(10 * block_size + 3))  # the last block is partial (B > 1)
    num_blocks = ceil_div(len(tokens), block_size)
    cache_tokens(cache, tokens)
    assert cache.evict(4) == 4
    kept = (num_blocks - 4) * block_size
    assert cache.match(tokens).num_cached_tokens == kept
    assert cache.total_tokens == kept
    cache.check_integrity()
    alloc.check_integrity(cache.held_refs())
    assert cache.evict(100) == num_blocks - 4 and cache.total_tokens == 0


def test_the_tree_reports_to_the_observer_it_was_given():
    """Every node that enters, splits, loses its tail or leaves is reported, in order, to the
    observer passed at construction, and a reset is bracketed."""
    calls = []

    class Recording(NoObserver):
        def added(self, node, namespace):
            calls.append(("added", tuple(node.key), namespace))

        def removed(self, node, medium):
            calls.append(("removed", tuple(node.key), medium))

        def trimmed(self, node, keep):
            calls.append(("trimmed", tuple(node.key), keep))

        def split(self, upper, lower):
            calls.append(("split", tuple(upper.key), tuple(lower.key)))

        def reset_started(self):
            calls.append(("reset",))

        def reset_done(self):
            calls.append(("reset done",))

    alloc = BlockAllocator(8)
    cache = RadixCache(alloc, 2, Recording())
    ns = CacheNamespace("t")
    blocks = alloc.allocate(3)
    cache.insert([1, 2, 3, 4, 5, 6], blocks, ns)
    alloc.decref(blocks)
    cache.match([1, 2, 3], ns)  # splits the edge after 3 tokens
    assert cache.evict(1) == 1  # trims [4, 5, 6] to [4]
    cache.reset()
    assert calls == [
        ("added", (1, 2, 3, 4, 5, 6), ns),
        ("split", (1, 2, 3), (4, 5, 6)),
        ("trimmed", (4, 5, 6), 1),
        ("reset",),
        ("removed", (4,), "GPU"),
        ("removed", (1, 2, 3), "GPU"),
        ("reset done",),
    ]
    assert cache.roots == [cache.root] and alloc.num_free == 8
    cache.check_integrity()


def test_format_tree():
    cache = RadixCache(BlockAllocator(8), 4)
    cache_tokens(cache, [1, 2, 3, 4, 5])
    cache.match([1, 2, 9])
    out = format_tree(cache)
    assert "[1, 2]" in out and "[3, 4, 5]" in out


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from(BLOCK_SIZES),
    seqs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=24), max_size=12),
    queries=st.lists(st.lists(st.integers(0, 2), max_size=28), max_size=8),
)
def test_matches_naive_model_without_eviction(block_size, seqs, queries):
    alloc = BlockAllocator(400)
    cache = RadixCache(alloc, block_size)
    naive = NaivePrefixCache(block_size)
    for i, seq in enumerate(seqs):
        blocks = alloc.allocate(ceil_div(len(seq), block_size))
        assert cache.insert(seq, blocks).num_new_tokens == naive.insert(seq, blocks)
        alloc.decref(blocks)
        if i % 2:
            q = queries[i % len(queries)] if queries else seq
            m = cache.match(q)
            assert (m.num_cached_tokens, m.blocks) == naive.match(q)
        cache.check_integrity()
    for q in queries:
        m = cache.match(q)
        assert (m.num_cached_tokens, m.blocks) == naive.match(q)
        assert m.handle.end == m.num_cached_tokens
    assert cache.total_tokens == naive.num_tokens()
    cache.check_integrity()
    alloc.check_integrity(cache.held_refs())
    cache.reset()
    assert alloc.num_free == alloc.num_blocks


# ---- simulated scheduler ------------------------------------------------------------


def prefix_hashes(tokens: list[int]) -> list[int]:
    """hs[p] identifies tokens[: p + 1] (the KV 'content' at position p)."""
    h, out = 0, []
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


@dataclass
class SimRequest:
    tokens: list[int]  # prompt + output: everything this request will compute
    hashes: list[int]  # prefix_hashes(tokens)
    handle: RadixNode  # locked node
    locked_len: int  # tokens covered by the locked handle
    computed: int  # tokens with KV written in `table`
    table: list[int] = field(default_factory=list)  # one reference held per entry


class RadixSim:
    """A toy scheduler driving RadixCache, checked after every operation."""

    def __init__(self, block_size: int, num_blocks: int, alphabet: int, max_len: int, seed: int):
        self.rng = random.Random(seed)
        self.bs, self.alphabet, self.max_len = block_size, alphabet, max_len
        self.alloc = BlockAllocator(num_blocks)
        self.cache = RadixCache(self.alloc, block_size)
        self.naive = NaivePrefixCache(block_size)
        self.kv: dict[int, list[int | None]] = {}  # block -> content hash per offset
        self.live: list[SimRequest] = []
        self.history: list[list[int]] = []
        self.num_evictions = 0
        self.num_mid_block_matches = 0
        self.max_live = 2 + seed % 4

    # -- helpers
    def random_tokens(self) -> list[int]:
        rng = self.rng
        if self.history and rng.random() < 0.85:
            base = rng.choice(self.history)
            cut = rng.randint(0, len(base))
            tokens = base[: max(cut, rng.randint(0, len(base)))]  # favour long shared prefixes
        else:
            tokens = []
        tail = rng.randint(0 if tokens else 1, max(1, self.max_len - len(tokens)))
        tokens = tokens + [rng.randrange(self.alphabet) for _ in range(tail)]
        return tokens[: self.max_len]

    def check_table(self, table: list[int], num_tokens: int, hashes: list[int]) -> None:
        for p in range(num_tokens):
            assert self.kv[table[p // self.bs]][p % self.bs] == hashes[p], f"bad KV at {p}"

    def evict(self, n: int) -> int:
        free_before, evictable = self.alloc.num_free, self.cache.evictable_blocks
        freed = self.cache.evict(n)
        self.num_evictions += 1
        assert self.alloc.num_free - free_before == freed <= evictable
        assert freed >= n or self.cache.evictable_blocks == 0
        self.sync_naive()
        return freed

    def sync_naive(self) -> None:
        """Eviction may only forget: restrict the naive model to what the tree holds."""
        self.naive.restrict_to(tree_paths(self.cache))
        for req in self.live:
            assert self.naive.match(req.tokens[: req.locked_len])[0] == req.locked_len

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
        assert m.handle.end == m.num_cached_tokens
        self.check_table(m.blocks, m.num_cached_tokens, prefix_hashes(tokens))
        return m

    # -- operations
    def start(self) -> list[int]:
        tokens = self.random_tokens()
        m = self.match(tokens)
        self.cache.lock(m.handle)
        n = m.num_cached_tokens
        req = SimRequest(tokens, prefix_hashes(tokens), m.handle, n, n, m.blocks[: n // self.bs])
        self.alloc.incref(req.table)
        self.live.append(req)
        if n % self.bs:  # copy-on-write of the partially matched block
            self.num_mid_block_matches += 1
            src = m.blocks[-1]
            got = self.allocate(1)
            if got is None:
                self.release(req)
                return tokens
            assert self.alloc.ref_counts[src] > 0, "locked block was freed"
            self.kv[got[0]][: n % self.bs] = self.kv[src][: n % self.bs]
            req.table += got
        return tokens

    def advance(self, req: SimRequest) -> None:
        end = min(len(req.tokens), req.computed + self.rng.randint(1, 2 * self.bs + 3))
        got = self.allocate(ceil_div(end, self.bs) - len(req.table))
        if got is None:
            return self.release(req)
        req.table += got
        for p in range(req.computed, end):
            row = self.kv[req.table[p // self.bs]]
            assert row[p % self.bs] is None, "write into a slot that already holds KV"
            row[p % self.bs] = req.hashes[p]
        req.computed = end

    def insert(self, req: SimRequest, finish: bool) -> None:
        tokens = req.tokens[: req.computed]
        res = self.cache.insert(tokens, req.table)
        assert res.num_new_tokens == self.naive.insert(tokens, req.table)
        assert res.handle.end == len(tokens)
        if finish:
            return self.release(req)
        self.cache.lock(res.handle)
        self.cache.unlock(req.handle)
        req.handle, req.locked_len = res.handle, req.computed

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
            self.release(rng.choice(self.live))  # abort
        elif r < 0.92:
            self.match(self.random_tokens())  # a query that locks nothing
        elif r < 0.995:
            self.evict(rng.randint(1, 4))
        else:
            self.cache.reset()
            assert self.cache.evictable_blocks == 0
            self.sync_naive()

    def check(self) -> None:
        cache, alloc, bs = self.cache, self.alloc, self.bs
        expected = cache.held_refs()
        for req in self.live:
            expected.update(req.table)
        alloc.check_integrity(expected)
        cache.check_integrity()
        assert cache.total_tokens == self.naive.num_tokens()
        assert cache.cached_blocks == len(cache.held_refs())
        unlocked = unlocked_refs(cache)
        exact = sum(1 for b in cache.held_refs() if alloc.ref_counts[b] == unlocked[b])
        assert cache.evictable_blocks == exact
        for req in self.live:
            assert req.handle.end == req.locked_len
            if req.handle is not cache.root:
                assert req.handle.parent is not None and req.handle.lock_ref > 0
        # Every tree position's block holds the KV of its path from the block start.
        stack = [(child, []) for child in cache.root.children.values()]
        while stack:
            node, hashes = stack.pop()
            hashes = hashes + prefix_hashes_from(hashes, node.key)
            for j, b in enumerate(node.blocks):
                last = min(node.end, (node.start // bs + j + 1) * bs) - 1
                first = (last // bs) * bs
                assert self.kv[b][: last - first + 1] == hashes[first : last + 1]
            stack.extend((child, hashes) for child in node.children.values())
        for key, per_token in self.naive.entries:
            assert self.naive.per_token_blocks(key) == (len(key), per_token)


def prefix_hashes_from(prev: list[int], tokens: list[int]) -> list[int]:
    h, out = (prev[-1] if prev else 0), []
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


SIM_CASES = [
    # (block_size, num_blocks, alphabet, max_len, seed, steps)
    (1, 48, 2, 40, 0, 2500),
    (1, 64, 3, 40, 1, 2500),
    (4, 32, 2, 48, 2, 2500),
    (4, 48, 3, 48, 3, 2500),
    (4, 24, 2, 40, 4, 2500),
    (16, 16, 2, 80, 5, 2500),
    (16, 24, 3, 96, 6, 2500),
    (16, 12, 2, 64, 7, 2500),
    (16, 32, 2, 128, 8, 2500),
]


@pytest.mark.parametrize("block_size,num_blocks,alphabet,max_len,seed,steps", SIM_CASES)
def test_simulated_scheduler(block_size, num_blocks, alphabet, max_len, seed, steps):
    sim = RadixSim(block_size, num_blocks, alphabet, max_len, seed)
    t0 = time.perf_counter()
    for _ in range(steps):
        sim.step()
        sim.check()
    for req in list(sim.live):
        sim.insert(req, finish=True)
        sim.check()
    sim.cache.reset()
    sim.sync_naive()
    sim.check()
    assert sim.cache.total_tokens == 0 and sim.alloc.num_free == num_blocks
    assert sim.num_evictions > 10, "workload too small to exercise eviction"
    if block_size > 1:
        assert sim.num_mid_block_matches > 10, "workload never diverged mid-block"
    assert time.perf_counter() - t0 < 30
