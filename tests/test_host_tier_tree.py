"""The radix tree's host tier alone: exact counts of the blocks written back and loaded where
edges end inside a block (a block index shared by a parent and its child moves once), and what
each reported tier counter counts."""

from __future__ import annotations

import pytest
from test_host_tier_failures import check_tree_content
from test_host_tier_scheduler import agent, make_core, multi_turn, put, tree

from radixrt.plan import SwapIn, SwapOut


def split_at(cache, tokens):
    """Match `tokens` + one unknown token: splits the edge the match ends in."""
    cache.match(list(tokens) + [9999])


def test_chain_inside_one_block_moves_it_once():
    """Edges [0, 6), [6, 7), [7, 12) (block size 4) all touch block 1: it is written back
    once and loaded once, from the deepest node's copy, for all three nodes."""
    cache, alloc = tree(num_blocks=8, host_blocks=8)
    put(cache, list(range(12)))
    split_at(cache, range(6))
    split_at(cache, range(7))
    a = cache.root.children[0]
    b = a.children[6]
    c = b.children[7]
    assert (a.end, b.end, c.end) == (6, 7, 12) and a.blocks[1] == b.blocks[0] == c.blocks[0]
    assert cache.evict(8) == 3
    outs = cache.take_swap_ops()
    assert len(outs) == 3 and all(isinstance(op, SwapOut) for op in outs)
    assert a.host_blocks[1] == b.host_blocks[0] == c.host_blocks[0]
    assert cache.host_cached_blocks == 3 and cache.host.stats.num_written_back_blocks == 3
    cache.check_integrity()
    m = cache.match(list(range(12)))
    assert m.num_host_tokens == 12
    cache.lock(m.handle)
    table = cache.load(m.handle)
    ins = cache.take_swap_ops()
    assert [type(op) for op in ins] == [SwapIn] * 3 and cache.host.stats.num_loaded_blocks == 3
    assert ins[1].host_block == c.host_blocks[0]  # the deepest copy of block 1
    assert table == [a.blocks[0], c.blocks[0], c.blocks[1]] and a.blocks[1] == b.blocks[0]
    assert alloc.num_free == 5 and alloc.ref_counts[table[1]] == 3  # a, b and c record it
    cache.check_integrity()
    cache.unlock(m.handle)
    cache.check_integrity()


def test_diverged_branches_keep_their_own_copies():
    """[0, 6) with children [6, 10) and [6, 8) (other tokens, another block 1): the parent
    shares one child's copy of block 1 on the host; loading the parent with the other child
    takes that child's copy, and the first child later loads its own."""
    cache, alloc = tree(num_blocks=8, host_blocks=8)
    put(cache, list(range(10)))
    put(cache, list(range(6)) + [50, 51])
    assert cache.evict(8) == 4
    assert len(cache.take_swap_ops()) == 4 and cache.host_cached_blocks == 4
    m = cache.match(list(range(6)) + [50, 51])
    cache.lock(m.handle)
    first = cache.load(m.handle)
    assert len(first) == 2 and len(cache.take_swap_ops()) == 2
    m2 = cache.match(list(range(10)))
    assert m2.num_host_tokens == 4  # [6, 10) only: the parent is on the device now
    cache.lock(m2.handle)
    second = cache.load(m2.handle)
    assert len(cache.take_swap_ops()) == 2
    assert second[0] == first[0] and second[1] != first[1]  # block 1 differs by branch
    assert cache.host.stats.num_loaded_blocks == 4
    cache.check_integrity()
    cache.unlock(m.handle)
    cache.unlock(m2.handle)
    cache.check_integrity()


def test_shared_copy_survives_host_eviction_of_the_child():
    """The host is full when the parent is written back: making room evicts the child whose
    copy of block 1 the parent shares; the parent keeps that block (its own reference)."""
    cache, alloc = tree(num_blocks=8, host_blocks=2)
    put(cache, list(range(10)))
    split_at(cache, range(6))
    top = cache.root.children[0]
    child = top.children[6]
    child_blocks, top_block = list(child.blocks), top.blocks[0]
    cache.evict(1)  # the child goes first (LRU): 2 host blocks, the host is full
    assert not child.blocks and len(child.host_blocks) == 2
    kept = child.host_blocks[0]
    assert cache.evict(8) == 2  # the parent: blocks 0 (new host block) and 1 (shared)
    cache.check_integrity()
    assert child.parent is None and not top.children  # evicted from the host
    assert top.host_blocks[1] == kept and cache.host.stats.num_host_evicted_blocks == 1
    assert [op.device_block for op in cache.take_swap_ops()] == [*child_blocks, top_block]
    assert cache.host.stats.num_written_back_blocks == 3 and cache.host_cached_blocks == 2


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("workload", [multi_turn, agent])
def test_counters_count_the_ops_and_copies_are_valid(workload, overlap):
    """Each reported tier counter against what it counts, on a workload whose edges end
    inside blocks: ops the runner executed, host blocks held, hit tokens of admissions."""
    core, runner = make_core(overlap=overlap, num_kv_blocks=40, host_blocks=120)
    hits: dict[str, int] = {}  # rid -> host tokens of its last successful _start
    start = core.scheduler.kv.start

    def recorded(req, m, ops):
        ok = start(req, m, ops)
        if ok and req.num_preemptions == 0:  # admitted unless it is released again
            hits[req.rid] = req.num_host_cached_tokens
        return ok

    core.scheduler.kv.start = recorded
    workload(core)
    check_tree_content(core, runner)
    s = core.stats()
    executed = [type(op).__name__ for op in runner.swaps]
    assert s["host_written_back_blocks"] == executed.count("SwapOut") > 0
    assert s["host_loaded_blocks"] == executed.count("SwapIn") > 0
    assert s["host_kv_blocks_cached"] == core.cache.host_cached_blocks
    assert s["host_kv_blocks_free"] + s["host_kv_blocks_cached"] == s["host_kv_blocks_total"]
    assert s["host_hit_tokens"] == sum(hits.values()) > 0


def test_host_evicts_copies_of_device_nodes_first():
    """Host room goes first to dropping the host copy of a node that is on the device too
    (no KV is lost), before an older host-only leaf (whose KV would be lost)."""
    cache, alloc = tree(num_blocks=8, host_blocks=3)
    old = list(range(4))
    put(cache, old)
    cache.evict(1)  # `old` is host-only now
    both = list(range(100, 104))
    put(cache, both)
    cache.evict(1)
    m = cache.match(both)
    cache.lock(m.handle)
    cache.load(m.handle)  # `both` is on both tiers (and newer than `old`)
    put(cache, list(range(200, 208)))  # 2 blocks
    assert cache.host.allocator.num_free == 1
    cache.evict(2)  # its write-back needs 2 host blocks: one is made free
    cache.check_integrity()
    assert cache.host.stats.num_host_evicted_blocks == 1
    assert not m.handle.host_blocks and m.handle.blocks  # the duplicate went
    assert cache.match(old).num_host_tokens == 4  # the host-only KV stayed
    cache.unlock(m.handle)
    cache.check_integrity()


def test_dropped_blocks_count_the_device_blocks_freed():
    """The host is full of a locked entry: a leaf whose first block its parent shares is
    dropped (that block stays with the parent), then the parent: 2 blocks freed, not 3."""
    cache, alloc = tree(num_blocks=8, host_blocks=1)
    pinned = list(range(100, 104))
    put(cache, pinned)
    cache.evict(1)
    cache.lock(cache.match(pinned).handle)  # host-only and locked: never evicted
    put(cache, list(range(8)))
    split_at(cache, range(6))  # [0, 6) and [6, 8) share block 1
    assert cache.evict(1) == 2  # the child frees nothing, then the parent frees 2
    assert cache.host.stats.num_dropped_blocks == 2 and cache.stats.num_evicted_blocks == 1 + 2
    assert cache.cached_blocks == 0 and cache.total_tokens == 4
    cache.check_integrity()


def test_leaf_larger_than_the_host_evicts_nothing_there():
    """A leaf of more blocks than the whole host pool is dropped at once: the host keeps its
    entries (before, making room flushed them all first)."""
    cache, alloc = tree(num_blocks=8, host_blocks=2)
    small = list(range(100, 104))
    put(cache, small)
    cache.evict(1)
    put(cache, list(range(12)))  # 3 blocks
    assert cache.evict(3) == 3
    assert (
        cache.host.stats.num_dropped_blocks == 3 and cache.host.stats.num_host_evicted_blocks == 0
    )
    assert cache.match(small).num_host_tokens == 4
    cache.check_integrity()


def test_host_drops_the_most_recent_duplicate_first():
    """Of two nodes on both tiers, the more recently used loses its host copy first: device
    eviction takes the older one first, which then needs no write-back."""
    cache, alloc = tree(num_blocks=8, host_blocks=2)
    handles = []
    for tokens in (list(range(4)), list(range(100, 104))):  # older, newer
        put(cache, tokens)
        cache.evict(1)
        m = cache.match(tokens)
        cache.lock(m.handle)
        cache.load(m.handle)  # on both tiers now, locked
        handles.append(m.handle)
    older, newer = handles
    put(cache, list(range(200, 204)))
    assert cache.evict(1) == 1  # the fresh leaf's write-back needs the one host block
    cache.check_integrity()
    assert older.host_blocks and not newer.host_blocks and newer.blocks
    for h in handles:
        cache.unlock(h)
    cache.check_integrity()
