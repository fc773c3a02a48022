"""The Redis storage backend against a real redis-server (tests/redis_server.py): the page
protocol, bad values as misses, and outages as `StorageUnavailable` with a bounded backoff."""

from __future__ import annotations

import time

import pytest
import redis
from redis_server import redis_server  # noqa: F401 (a fixture)

from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.cache.storage import HEADER, PageKeyer, StorageIdentity, StorageUnavailable
from radixrt.cache.storage_redis import RedisBackend, without_password

BS = 4
PAGE = 64
KEYER = PageKeyer(StorageIdentity("tiny", "r1", "float32", "", "page-first"), BS)


def page(fill: int) -> bytearray:
    return bytearray([fill % 256]) * PAGE


def name(key: bytes) -> bytes:
    return b"radixrt:kv:" + key.hex().encode()


def test_round_trip_exists_and_delete(redis_server):  # noqa: F811
    store = RedisBackend(redis_server.url, PAGE)
    keys = KEYER.keys(list(range(12)), DEFAULT_NAMESPACE)
    assert store.set(keys[:2], [page(1), page(2)]) == []  # the server evicts, unseen
    store.set(keys[:1], [page(9)])  # a key already stored keeps its page
    assert store.exists(keys) == [True, True, False]
    out = [bytearray(PAGE) for _ in keys]
    assert store.get(keys, out) == [True, True, False]
    assert out[:2] == [page(1), page(2)]
    s = store.stats()
    assert (s.hits, s.misses, s.pages_written, s.num_pages) == (2, 1, 2, 2)
    assert (s.bytes_read, s.bytes_written) == (2 * PAGE, 2 * PAGE)
    assert s.num_bytes == 2 * (HEADER.size + PAGE)
    store.delete(keys[:1])
    assert store.exists(keys[:2]) == [False, True]
    assert store.stats().num_pages == 1
    # a second client (another replica) reads what the first wrote
    other = RedisBackend(redis_server.url, PAGE)
    buf = bytearray(PAGE)
    assert other.get(keys[1:2], [buf]) == [True] and buf == page(2)
    store.close()
    other.close()


def test_large_batches_are_split(redis_server):  # noqa: F811
    store = RedisBackend(redis_server.url, PAGE, batch_bytes=3 * (HEADER.size + PAGE))
    assert store.batch_pages == 3
    keys = KEYER.keys(list(range(4 * 8)), DEFAULT_NAMESPACE)
    store.set(keys[:7], [page(i) for i in range(7)])
    out = [bytearray(PAGE) for _ in keys]
    assert store.get(keys, out) == [True] * 7 + [False]
    assert out[:7] == [page(i) for i in range(7)]
    assert store.stats().pages_written == 7


def test_salted_keys_share_no_value(redis_server):  # noqa: F811
    store = RedisBackend(redis_server.url, PAGE)
    tokens = list(range(8))
    a = KEYER.keys(tokens, CacheNamespace("a"))
    store.set(a, [page(1), page(2)])
    assert store.exists(KEYER.keys(tokens, CacheNamespace("b"))) == [False, False]
    assert store.exists(KEYER.keys(tokens, DEFAULT_NAMESPACE)) == [False, False]
    assert store.exists(a) == [True, True]


@pytest.mark.parametrize("damage", ["payload", "truncate", "foreign", "other_size", "magic"])
def test_bad_value_is_a_miss_and_deleted(redis_server, damage):  # noqa: F811
    store = RedisBackend(redis_server.url, PAGE)
    raw = redis.Redis.from_url(redis_server.url)
    k1, k2 = KEYER.keys(list(range(8)), DEFAULT_NAMESPACE)
    store.set([k1, k2], [page(1), page(2)])
    value = bytearray(raw.get(name(k1)))
    if damage == "payload":
        value[HEADER.size + 5] ^= 0xFF
    elif damage == "truncate":
        value = value[:-3]
    elif damage == "foreign":  # another key's (valid) page under this name
        value = bytearray(raw.get(name(k2)))
    elif damage == "other_size":  # written by a process with another page size
        raw.delete(name(k1))
        RedisBackend(redis_server.url, 2 * PAGE).set([k1], [bytearray(2 * PAGE)])
        value = bytearray(raw.get(name(k1)))
    else:
        value[0] ^= 0xFF
    raw.set(name(k1), bytes(value))
    out = [bytearray(PAGE), bytearray(PAGE)]
    assert store.get([k1, k2], out) == [False, True] and out[1] == page(2)
    assert store.exists([k1]) == [False]  # deleted when found
    s = store.stats()
    assert (s.corrupt, s.misses, s.hits) == (1, 1, 1)


def test_outage_fails_fast_then_reconnects(redis_server):  # noqa: F811
    store = RedisBackend(redis_server.url, PAGE, timeout_s=0.5, first_backoff_s=0.3)
    keys = KEYER.keys(list(range(8)), DEFAULT_NAMESPACE)
    store.set(keys[:1], [page(1)])
    redis_server.stop()
    with pytest.raises(StorageUnavailable):
        store.exists(keys)
    assert store.down
    t0 = time.monotonic()
    for _ in range(100):  # inside the backoff interval: no network, no wait
        with pytest.raises(StorageUnavailable):
            store.get(keys, [bytearray(PAGE), bytearray(PAGE)])
    assert time.monotonic() - t0 < 0.2
    while store.down:
        time.sleep(0.05)
    with pytest.raises(StorageUnavailable):  # still down: the next interval is longer
        store.set(keys[1:], [page(2)])
    first_interval_end = time.monotonic()
    redis_server.start()  # empty: it kept nothing
    while store.down:
        time.sleep(0.05)
    assert time.monotonic() - first_interval_end > 0.4  # it doubled (0.3 s, then 0.6 s)
    store.set(keys[1:], [page(2)])
    assert store.exists(keys) == [False, True]
    store.close()


def test_messages_mask_the_password():
    assert without_password("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert without_password("rediss://user:s3cret@h/1") == "rediss://user:***@h/1"
    assert without_password("redis://h:6379/0") == "redis://h:6379/0"


def test_a_full_store_refuses_writes_and_still_reads(redis_server, tmp_path):  # noqa: F811
    keys = KEYER.keys(list(range(8)), DEFAULT_NAMESPACE)
    RedisBackend(redis_server.url, PAGE).set(keys[:1], [page(1)])
    raw = redis.Redis.from_url(redis_server.url)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", "1")  # below what the server uses: every write is refused
    store = RedisBackend(redis_server.url, PAGE)
    with pytest.raises(StorageUnavailable, match="refused 1 pages"):
        store.set(keys[1:], [page(2)])
    assert not store.down  # reads go on
    out = [bytearray(PAGE), bytearray(PAGE)]
    assert store.get(keys, out) == [True, False] and out[0] == page(1)
    assert store.stats().pages_written == 0
