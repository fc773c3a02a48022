"""The Redis storage backend (`--kv-storage redis://host:port/db`): one value per page, shared
by every process that names the same server and database.

A page is the value of `radixrt:kv:<key hex>`: the header of `radixrt.cache.storage.page_header`
then the payload, as the local directory stores it, so a value that is short, for another key,
of another format or failing its checksum is a miss (and is deleted): never wrong KV. Writes
use `SET NX` (a key already stored keeps its page); a batch goes in one pipeline round trip
(one `MGET` to read), split so that none carries more than `batch_bytes`.
The server bounds its memory (`maxmemory` with an LRU `maxmemory-policy`): this backend deletes
nothing for room, and `num_pages`/`num_bytes` count what this process wrote, less what it
deleted. The server's evictions are invisible here: KV events learn of them only when a fetch
misses the page (`radixrt.executor.storage_io`).

A server that answers but refuses writes (full, with `maxmemory-policy noeviction`) fails
them with `StorageUnavailable` (logged once) and still serves reads. When the server cannot
be reached or does not answer within `timeout_s`, the call raises
`StorageUnavailable` and the backend stays down for an interval that doubles with each failed
try (`redis.backoff.ExponentialBackoff`, capped at `max_backoff_s`): calls in that interval
fail at once, without touching the network; the first call after it tries again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import replace
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from radixrt.cache.storage import (
    HEADER,
    StorageStats,
    StorageUnavailable,
    check_header,
    page_header,
)

logger = logging.getLogger(__name__)

KEY_PREFIX = b"radixrt:kv:"
# Transport failures: the server is gone, restarting or stalled.
DOWN_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class RedisBackend:
    """See the module docstring. Thread-safe (the client pools its connections; one lock
    around the counters and the down state)."""

    def __init__(
        self,
        url: str,
        page_bytes: int,
        timeout_s: float = 2.0,
        first_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        batch_bytes: int = 64 << 20,
    ) -> None:
        if page_bytes < 1:
            raise ValueError(f"page_bytes must be >= 1, got {page_bytes}")
        self.where = without_password(url)  # for messages and logs
        self.page_bytes = page_bytes
        # pages per MGET / SET pipeline: bounds the client's and the server's buffers
        self.batch_pages = max(1, batch_bytes // (HEADER.size + page_bytes))
        # One quiet retry replaces a pooled connection the server closed (it restarted);
        # longer outages are the backoff's.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._backoff = ExponentialBackoff(cap=max_backoff_s, base=first_backoff_s)
        self._lock = threading.Lock()
        self._stats = StorageStats()
        self._failures = 0  # consecutive failed tries
        self._down_until = 0.0  # time.monotonic() before which calls fail without trying
        self._refused = False  # a write was refused once (logged once)
        # an unreachable store is logged; the engine computes until it answers
        with contextlib.suppress(StorageUnavailable):
            self._call(self._client.ping)

    # ---- the protocol ----
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._name(key))
        return [bool(n) for n in self._call(pipe.execute)]

    def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[bool]:
        assert len(keys) == len(buffers)
        out: list[bool] = []
        for i in range(0, len(keys), self.batch_pages):
            batch = slice(i, i + self.batch_pages)
            out += self._get_batch(keys[batch], buffers[batch])
        return out

    def _get_batch(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[bool]:
        values = self._call(self._client.mget, [self._name(k) for k in keys])
        out, bad = [], []
        for key, buf, value in zip(keys, buffers, values, strict=True):
            ok = value is not None and self._unpack(key, value, buf)
            if value is not None and not ok:
                bad.append(key)
            out.append(ok)
        with self._lock:
            self._stats.hits += sum(out)
            self._stats.misses += len(out) - sum(out)
            self._stats.bytes_read += sum(out) * self.page_bytes
            self._stats.corrupt += len(bad)
        if bad:
            self._call(self._client.delete, *[self._name(k) for k in bad])
        return out

    def set(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[bytes]:
        """Store the pages; deletes none for room (the server evicts, unseen: [])."""
        assert len(keys) == len(buffers)
        for i in range(0, len(keys), self.batch_pages):
            batch = slice(i, i + self.batch_pages)
            self._set_batch(keys[batch], buffers[batch])
        return []

    def _set_batch(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key, buf in zip(keys, buffers, strict=True):
            data = memoryview(buf).cast("B")
            assert len(data) == self.page_bytes, f"a page of {len(data)} bytes"
            pipe.set(self._name(key), page_header(key, data) + data, nx=True)
        results = self._call(pipe.execute, False)  # raise_on_error=False: count each page
        refused = [r for r in results if isinstance(r, Exception)]
        written = sum(r is True for r in results)
        with self._lock:
            self._stats.pages_written += written
            self._stats.bytes_written += written * self.page_bytes
            self._stats.num_pages += written
            self._stats.num_bytes += written * (HEADER.size + self.page_bytes)
            first_refusal = refused and not self._refused
            self._refused = self._refused or bool(refused)
        if refused:  # the server answers but will not store (full under `noeviction`, ...)
            if first_refusal:
                logger.warning("kv storage: redis at %s refuses writes: %s", self.where, refused[0])
            raise StorageUnavailable(f"redis at {self.where} refused {len(refused)} pages")

    def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        gone = self._call(self._client.delete, *[self._name(k) for k in keys])
        with self._lock:
            self._stats.num_pages -= min(gone, self._stats.num_pages)
            self._stats.num_bytes = self._stats.num_pages * (HEADER.size + self.page_bytes)

    def stats(self) -> StorageStats:
        with self._lock:
            return replace(self._stats)

    def close(self) -> None:
        self._client.close()

    @property
    def down(self) -> bool:
        """Whether calls fail now without trying the server (in a backoff interval)."""
        with self._lock:
            return time.monotonic() < self._down_until

    # ---- the connection ----
    @staticmethod
    def _name(key: bytes) -> bytes:
        return KEY_PREFIX + key.hex().encode()

    def _unpack(self, key: bytes, value: bytes, buf: memoryview) -> bool:
        """Copy `value`'s payload into `buf` if it is `key`'s page and checks."""
        crc = check_header(value[: HEADER.size], key, self.page_bytes)
        payload = memoryview(value)[HEADER.size :]
        if crc is None or len(payload) != self.page_bytes or zlib.crc32(payload) != crc:
            return False
        memoryview(buf).cast("B")[:] = payload
        return True

    def _call(self, fn, *args):
        """`fn(*args)` against the server, with the down state (see the module docstring)."""
        with self._lock:
            wait = self._down_until - time.monotonic()
            if wait > 0:
                raise StorageUnavailable(f"redis at {self.where} is down; next try in {wait:.1f}s")
        try:
            result = fn(*args)
        except DOWN_ERRORS as e:
            with self._lock:
                delay = self._backoff.compute(self._failures)
                self._failures += 1
                self._down_until = time.monotonic() + delay
                first = self._failures == 1
            if first:
                logger.warning(
                    "kv storage: redis at %s unreachable (%s); backing off", self.where, e
                )
            raise StorageUnavailable(f"redis at {self.where}: {e}") from e
        with self._lock:
            back, self._failures = self._failures, 0
        if back:
            logger.warning("kv storage: redis at %s reachable again", self.where)
        return result


def without_password(url: str) -> str:
    """`url` with any password in it masked."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
