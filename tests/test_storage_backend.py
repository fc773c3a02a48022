"""The storage tier's page keys and the local-directory backend (plain Python)."""

from __future__ import annotations

import os
import time

import pytest

from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.cache.storage import PageKeyer, StorageIdentity
from radixrt.cache.storage_local import HEADER, LocalDirBackend

BS = 4
PAGE = 64


def identity(**kw) -> StorageIdentity:
    fields = dict(
        model="tiny", revision="r1", kv_dtype="float32", kv_scales="", layout="page-first"
    )
    fields.update(kw)
    return StorageIdentity(**fields)


def page(fill: int) -> bytearray:
    return bytearray([fill % 256]) * PAGE


def test_keys_chain_over_the_whole_prefix():
    keyer = PageKeyer(identity(), BS)
    a = keyer.keys(list(range(10)), DEFAULT_NAMESPACE)
    assert len(a) == 2  # the partial third block has no key
    assert keyer.keys(list(range(8)), DEFAULT_NAMESPACE) == a
    # the same second block after a different first block is another page
    b = keyer.keys([9, 9, 9, 9, 4, 5, 6, 7], DEFAULT_NAMESPACE)
    assert b[1] != a[1]
    assert PageKeyer(identity(), BS).keys(list(range(8)), DEFAULT_NAMESPACE) == a  # stable


@pytest.mark.parametrize(
    "other",
    [
        {"model": "other"},
        {"revision": "r2"},
        {"kv_dtype": "fp8_e4m3"},
        {"kv_scales": "k 0.5 v 0.5"},
        {"layout": "page-first [2, 2, 8, 1, 4]"},
        {"tp_rank": 1},
    ],
)
def test_keys_differ_by_identity(other):
    tokens = list(range(8))
    base = PageKeyer(identity(), BS).keys(tokens, DEFAULT_NAMESPACE)
    assert set(PageKeyer(identity(**other), BS).keys(tokens, DEFAULT_NAMESPACE)).isdisjoint(base)


def test_keys_differ_by_salt():
    keyer, tokens = PageKeyer(identity(), BS), list(range(8))
    plain = keyer.keys(tokens, DEFAULT_NAMESPACE)
    a = keyer.keys(tokens, CacheNamespace("a"))
    b = keyer.keys(tokens, CacheNamespace("b"))
    assert len({*plain, *a, *b}) == 6


def test_local_round_trip_and_exists(tmp_path):
    store = LocalDirBackend(tmp_path, PAGE, 1 << 20)
    keys = PageKeyer(identity(), BS).keys(list(range(12)), DEFAULT_NAMESPACE)
    store.set(keys[:2], [page(1), page(2)])
    assert store.exists(keys) == [True, True, False]
    out = [bytearray(PAGE) for _ in keys]
    assert store.get(keys, out) == [True, True, False]
    assert out[:2] == [page(1), page(2)]
    s = store.stats()
    assert (s.hits, s.misses, s.num_pages, s.pages_written) == (2, 1, 2, 2)
    assert s.num_bytes == 2 * (HEADER.size + PAGE)
    assert not list(tmp_path.rglob("*.tmp"))  # written under a temporary name, then renamed
    store.delete(keys[:1])
    assert store.exists(keys[:2]) == [False, True]


def corrupt_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage", ["payload", "truncate", "foreign", "other_size", "magic", "delete"]
)
def test_local_bad_page_is_a_miss(tmp_path, damage):
    store = LocalDirBackend(tmp_path, PAGE, 1 << 20)
    k1, k2 = PageKeyer(identity(), BS).keys(list(range(8)), DEFAULT_NAMESPACE)
    store.set([k1, k2], [page(1), page(2)])
    path = store.path_of(k1)
    if damage == "payload":
        corrupt_byte(path, HEADER.size + 5)
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-3])
    elif damage == "foreign":  # another key's (valid) page under this name
        os.replace(store.path_of(k2), path)
    elif damage == "other_size":  # a page written by a process with another page size
        LocalDirBackend(tmp_path / "x", PAGE * 2, 1 << 20).set([k1], [bytearray(PAGE * 2)])
        os.replace((tmp_path / "x") / path.relative_to(tmp_path), path)
    elif damage == "magic":
        corrupt_byte(path, 0)
    else:
        path.unlink()
    buf = bytearray(PAGE)
    assert store.get([k1], [buf]) == [False]
    assert store.exists([k1]) == [False]  # dropped from the index
    assert not path.exists()
    assert store.stats().corrupt == (0 if damage == "delete" else 1)


def test_local_size_bound_deletes_least_recently_used(tmp_path):
    size = HEADER.size + PAGE
    store = LocalDirBackend(tmp_path, PAGE, 3 * size)
    keys = PageKeyer(identity(), BS).keys(list(range(4 * 5)), DEFAULT_NAMESPACE)
    store.set(keys[:3], [page(i) for i in range(3)])
    store.get(keys[:1], [bytearray(PAGE)])  # keys[0] is now the most recently used
    assert store.set(keys[3:5], [page(3), page(4)]) == [keys[1], keys[2]]  # deleted for room
    assert store.exists(keys) == [True, False, False, True, True]
    assert store.stats().pages_evicted == 2
    assert len(list(tmp_path.rglob("*.kvpage"))) == 3


def test_local_reopen_finds_pages_in_lru_order(tmp_path):
    size = HEADER.size + PAGE
    keys = PageKeyer(identity(), BS).keys(list(range(16)), DEFAULT_NAMESPACE)
    store = LocalDirBackend(tmp_path, PAGE, 4 * size)
    for i, k in enumerate(keys[:3]):
        store.set([k], [page(i)])
        os.utime(store.path_of(k), ns=(time.time_ns(), (1_000 + i) * 10**9))
    os.utime(store.path_of(keys[0]), ns=(time.time_ns(), 2_000 * 10**9))  # used last
    stale = tmp_path / keys[0].hex()[:2] / "old.tmp"
    stale.write_bytes(b"torn")
    os.utime(stale, (0, 0))
    again = LocalDirBackend(tmp_path, PAGE, 3 * size)
    assert again.stats().num_pages == 3 and not stale.exists()
    again.set([keys[3]], [page(3)])  # over the bound: keys[1] is the least recently used
    assert again.exists(keys[:4]) == [True, False, True, True]
    out = bytearray(PAGE)
    assert again.get([keys[0]], [out]) == [True] and out == page(0)


def test_local_finds_pages_another_process_wrote(tmp_path):
    keys = PageKeyer(identity(), BS).keys(list(range(8)), DEFAULT_NAMESPACE)
    mine, theirs = (
        LocalDirBackend(tmp_path, PAGE, 1 << 20),
        LocalDirBackend(tmp_path, PAGE, 1 << 20),
    )
    theirs.set(keys, [page(1), page(2)])
    assert mine.stats().num_pages == 0
    assert mine.exists(keys) == [True, True]
    assert mine.stats().num_pages == 2  # indexed now
    out = bytearray(PAGE)
    assert mine.get(keys[1:], [out]) == [True] and out == page(2)
