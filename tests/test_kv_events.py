"""KV events of the radix tree: vLLM's block hashes against a reimplementation written from
vLLM's spec (its own CBOR encoder, no cbor2), and the event stream replayed into an empty
index against the tree's full blocks per tier after every operation (splits, trims,
evictions with and without a host tier, loads, discards, reset).

Follows vLLM v0.11.0 (`VLLM_VERSION`): `vllm/distributed/kv_events.py` (array-like msgspec
structs, tag first) and `vllm/v1/core/kv_cache_utils.py` (`hash_block_tokens` with
`sha256_cbor`, `NONE_HASH = sha256_cbor(PYTHONHASHSEED)`, 64-bit integer hashes in events).
"""

from __future__ import annotations

import hashlib
import random
import struct

import msgspec
import pytest

from radixrt.cache import CacheNamespace, create_prefix_cache
from radixrt.cache.kv_events import (
    VLLM_VERSION,
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    none_hash,
)
from radixrt.cache.radix import RadixCache
from radixrt.cache.radix_events import RadixEventRecorder
from radixrt.kv.allocator import BlockAllocator

SEED = "0"


# ---- an independent reimplementation of vLLM's hashing (RFC 8949 canonical CBOR) ----
def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise AssertionError(n)


def cbor(value) -> bytes:
    if value is None:
        return b"\xf6"
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode()
        return _head(3, len(data)) + data
    if isinstance(value, int):
        return _head(0, value) if value >= 0 else _head(1, -1 - value)
    if isinstance(value, tuple | list):
        return _head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise AssertionError(type(value))


def ref_hashes(tokens: list[int], block_size: int, seed: str = SEED, extra=None) -> list[int]:
    """vLLM's chain for every full block of `tokens`, as the 64-bit ints events carry."""
    parent = hashlib.sha256(cbor(seed)).digest()  # NONE_HASH
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(cbor((parent, block, extra))).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def test_pinned_vllm_version():
    assert VLLM_VERSION == "0.11.0"


def test_hash_chain_matches_reimplementation():
    rng = random.Random(1)
    for bs in (1, 4, 16):
        tokens = [rng.randrange(0, 200_000) for _ in range(5 * bs + 3)]
        hasher = BlockHasher(bs, SEED)
        got = hasher.chain(None, tokens[: 5 * bs])
        assert [int.from_bytes(h[-8:], "big") for h in got] == ref_hashes(tokens, bs)[:5]
        # chaining from a parent continues the same sequence
        tail = hasher.chain(got[1], tokens[2 * bs : 5 * bs])
        assert tail == got[2:]
    salted = BlockHasher(4, SEED, extra_keys=("tenant-a",)).chain(None, list(range(8)))
    want = ref_hashes(list(range(8)), 4, extra=("tenant-a",))
    assert [int.from_bytes(h[-8:], "big") for h in salted] == want
    assert want != ref_hashes(list(range(8)), 4)


def test_none_hash_seed(monkeypatch):
    assert none_hash("0") == hashlib.sha256(b"\x61\x30").digest()  # CBOR text "0"
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert none_hash(None) == none_hash("7")
    monkeypatch.delenv("PYTHONHASHSEED")
    assert none_hash(None) != none_hash(None)  # random, as vLLM without a seed


def test_wire_format_is_vllms():
    """msgpack arrays, tag first, as vLLM v0.11.0's array-like msgspec structs encode."""
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([11, 12], None, [1, 2, 3, 4], 2, None, "GPU"),
            BlockRemoved([11], "CPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert raw == [
        1.5,
        [
            ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU"],
            ["BlockRemoved", [11], "CPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]


# ---- replaying the stream, and what the tree holds ----
class Index:
    """What an event-driven router keeps: per medium, block hash -> parent hash."""

    def __init__(self, mediums: tuple[str, ...] = ("GPU", "CPU")) -> None:
        self.blocks: dict[str, dict[int, int | None]] = {m: {} for m in mediums}

    def apply(self, payload: bytes) -> None:
        ts, events, *_ = msgspec.msgpack.decode(payload)
        for ev in events:
            if ev[0] == "BlockStored":
                _, hashes, parent, tokens, bs, _lora, medium = ev
                assert len(tokens) == bs * len(hashes)
                table = self.blocks[medium]
                for h in hashes:
                    assert h not in table, "stored twice"
                    table[h] = parent
                    parent = h
            elif ev[0] == "BlockRemoved":
                _, hashes, medium = ev
                for h in hashes:
                    del self.blocks[medium][h]  # KeyError: removed what was not stored
            else:
                assert ev == ["AllBlocksCleared"]
                for table in self.blocks.values():
                    table.clear()


def tree_blocks(cache: RadixCache) -> dict[str, dict[int, int | None]]:
    """Per medium, hash -> parent of every full block the tree holds (recomputed from each
    node's path tokens with the reference hashing)."""
    bs = cache.block_size
    out: dict[str, dict[int, int | None]] = {"GPU": {}, "CPU": {}}
    stack = [(c, list(c.key)) for c in cache.root.children.values()]
    while stack:
        node, tokens = stack.pop()
        chain = ref_hashes(tokens, bs)
        for i in range(node.start // bs, node.end // bs):
            parent = chain[i - 1] if i else None
            if node.blocks:
                out["GPU"][chain[i]] = parent
            if node.host_blocks:
                out["CPU"][chain[i]] = parent
        stack += [(c, tokens + c.key) for c in node.children.values()]
    return out


def publish(recorder: RadixEventRecorder, index: Index) -> None:
    payload = msgspec.msgpack.encode(KVEventBatch(0.0, recorder.take(), 0))
    index.apply(payload)


def check(cache: RadixCache, recorder: RadixEventRecorder, index: Index) -> None:
    publish(recorder, index)
    want = tree_blocks(cache)
    assert index.blocks == want
    for medium in ("GPU", "CPU"):
        assert recorder.held(medium) == set(want[medium])
    cache.check_integrity()


def make(num_blocks=64, bs=4, host=0):
    recorder = RadixEventRecorder(BlockHasher(bs, SEED))
    alloc = BlockAllocator(num_blocks)
    cache = create_prefix_cache("radix", alloc, bs, host, recorder)
    return cache, alloc, recorder, Index()


def insert(cache: RadixCache, alloc: BlockAllocator, tokens: list[int]) -> None:
    """Insert `tokens` as a finished request would, with fresh blocks past the match."""
    m = cache.match(tokens)
    cache.lock(m.handle)
    bs = cache.block_size
    if m.num_host_tokens:
        table = cache.load(m.handle)
        assert table is not None
    else:
        table = m.blocks
    full = len(table) if m.num_cached_tokens % bs == 0 else len(table) - 1
    blocks = list(table[:full])
    alloc.incref(blocks)
    need = -(-len(tokens) // bs) - len(blocks)
    if alloc.num_free < need:
        cache.evict(need - alloc.num_free)
    blocks += alloc.allocate(need)
    cache.insert(tokens, blocks)
    cache.unlock(m.handle)
    alloc.decref(blocks)


@pytest.mark.parametrize("host", [0, 24])
def test_tree_operations_replay_to_the_tree(host):
    cache, alloc, rec, index = make(num_blocks=24, host=host)
    base = list(range(100, 110))  # 2.5 blocks
    insert(cache, alloc, base + [1, 2, 3, 4, 5, 6])
    check(cache, rec, index)
    insert(cache, alloc, base + [1, 2, 9, 9, 9, 9, 9])  # splits inside a block
    check(cache, rec, index)
    cache.match(base[:5])  # a split inside block 1, mid-edge
    check(cache, rec, index)
    assert not rec.take()  # splits emit nothing
    rng = random.Random(host)
    for i in range(40):
        n = rng.randrange(1, 30)
        tokens = base[: rng.randrange(0, 11)] + [rng.randrange(1, 6) for _ in range(n)]
        insert(cache, alloc, tokens)
        check(cache, rec, index)
        if i % 7 == 6:
            cache.evict(rng.randrange(1, 8))
            check(cache, rec, index)
    cache.reset()
    publish(rec, index)
    assert index.blocks == {"GPU": {}, "CPU": {}} == tree_blocks(cache)


def test_reset_with_a_locked_path_removes_only_the_rest():
    cache, alloc, rec, index = make()
    insert(cache, alloc, list(range(12)))
    insert(cache, alloc, list(range(100, 112)))
    m = cache.match(list(range(12)))
    cache.lock(m.handle)
    check(cache, rec, index)
    cache.reset()
    events = rec.take()
    assert [type(e) for e in events] == [BlockRemoved]
    index.apply(msgspec.msgpack.encode(KVEventBatch(0.0, events)))
    assert index.blocks == tree_blocks(cache) and len(index.blocks["GPU"]) == 3
    cache.unlock(m.handle)
    cache.reset()
    assert [type(e) for e in rec.take()] == [AllBlocksCleared]


def test_trim_removes_the_tail_blocks():
    cache, alloc, rec, index = make(num_blocks=8)
    insert(cache, alloc, list(range(30)))  # 8 blocks, 7 full
    check(cache, rec, index)
    cache.evict(3)  # no host tier: the long leaf loses its tail
    check(cache, rec, index)
    assert len(index.blocks["GPU"]) == 5


def test_host_tier_moves_blocks_between_media():
    cache, alloc, rec, index = make(num_blocks=8, host=16)
    insert(cache, alloc, list(range(16)))
    check(cache, rec, index)
    cache.evict(4)  # written back
    check(cache, rec, index)
    assert len(index.blocks["GPU"]) == 0 and len(index.blocks["CPU"]) == 4
    insert(cache, alloc, list(range(16)) + [7, 7, 7, 7])  # loads the host copy back
    check(cache, rec, index)
    assert len(index.blocks["GPU"]) == 5 and len(index.blocks["CPU"]) == 4
    cache.discard_copies(set(cache.match(list(range(16))).blocks), set())
    check(cache, rec, index)
    cache.reset()
    check(cache, rec, index)


def test_salted_subtrees_publish_their_own_hashes():
    """The same tokens under different cache salts are different blocks to a router: the
    first block's extra keys carry the salt (as vLLM's cache_salt), so no hash is shared;
    under one salt they are the same blocks."""
    cache, alloc, recorder, _ = make()
    tokens = list(range(100, 116))  # 4 full blocks
    stored: dict[str | None, list[int]] = {}
    for salt in (None, "tenant-a", "tenant-b", "tenant-a"):
        cache.insert(tokens, alloc.allocate(4), namespace=CacheNamespace(salt))
        hashes = [h for e in recorder.take() if isinstance(e, BlockStored) for h in e.block_hashes]
        stored.setdefault(salt, []).extend(hashes)
    assert len(stored[None]) == len(stored["tenant-b"]) == 4
    assert len(stored["tenant-a"]) == 4  # the second insert under tenant-a stored nothing new
    assert len(set(stored[None]) | set(stored["tenant-a"]) | set(stored["tenant-b"])) == 12
    cache.check_integrity()
