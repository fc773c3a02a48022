"""The local-directory storage backend (`--kv-storage DIR`): one file per page.

A page lives in `DIR/<first two hex digits of its key>/<key hex>.kvpage`: a header
(`radixrt.cache.storage.page_header`: magic, format version, the page's own key, payload
length, CRC-32 of the payload) then the payload.
A write goes to a temporary name in the same folder and is renamed into place, so a crash or a
concurrent reader never sees a torn page under the final name. A read that finds the file
missing, short, for another key, of another format or failing its checksum is a miss (and the
bad file is deleted): never wrong KV.

The directory is bounded by `max_bytes`: after a write, least recently used pages (by the
in-memory order, rebuilt from the files' modification times when the backend opens) are
deleted until it fits (`set` returns their keys). A hit refreshes the file's modification
time, so the order survives a restart. Several processes may share a directory: `exists` finds
the pages another one wrote since (a stat per key this process has not indexed), and each
bounds the size it sees (they may over-count it between restarts).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from radixrt.cache.storage import HEADER, KEY_BYTES, StorageStats, check_header, page_header

SUFFIX = ".kvpage"
STALE_TMP_S = 600  # a temporary file older than this belongs to no live writer


class LocalDirBackend:
    """See the module docstring. Thread-safe (one lock around the index; file I/O outside
    it)."""

    def __init__(self, root: str | os.PathLike, page_bytes: int, max_bytes: int) -> None:
        if page_bytes < 1:
            raise ValueError(f"page_bytes must be >= 1, got {page_bytes}")
        if max_bytes < HEADER.size + page_bytes:
            raise ValueError(f"kv_storage_max_gb holds no page of {page_bytes} bytes; raise it")
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # tenants' KV
        self.page_bytes = page_bytes
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self._bytes = 0
        self._stats = StorageStats()
        self._tmp_ids = iter(range(1 << 62))
        self._scan()

    # ---- the protocol ----
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Indexed keys, and files another process wrote since this one indexed (they join
        the index)."""
        with self._lock:
            out = [k in self._lru for k in keys]
        for i, key in enumerate(keys):
            if not out[i]:
                out[i] = self._adopt(key)
        return out

    def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[bool]:
        out = []
        for key, buf in zip(keys, buffers, strict=True):
            ok = self._read(key, buf)
            with self._lock:
                if ok:
                    self._stats.hits += 1
                    self._stats.bytes_read += self.page_bytes
                    if key in self._lru:
                        self._lru.move_to_end(key)
                else:
                    self._stats.misses += 1
            out.append(ok)
        return out

    def set(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[bytes]:
        """Write the pages not indexed yet; the keys deleted for room (least recently used)."""
        deleted = []
        for key, buf in zip(keys, buffers, strict=True):
            with self._lock:
                if key in self._lru:
                    self._lru.move_to_end(key)
                    continue
            deleted += self._write(key, buf)
        return deleted

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._unlink(key)

    def stats(self) -> StorageStats:
        with self._lock:
            return replace(self._stats, num_pages=len(self._lru), num_bytes=self._bytes)

    def close(self) -> None:
        """Nothing to release: every call opens and closes its files."""

    # ---- files ----
    def path_of(self, key: bytes) -> Path:
        """Where `key`'s page lives."""
        name = key.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def _read(self, key: bytes, buf: memoryview) -> bool:
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                crc = check_header(f.read(HEADER.size), key, self.page_bytes)
                if crc is None:
                    return self._bad(key)
                view = memoryview(buf).cast("B")
                if f.readinto(view) != self.page_bytes or f.read(1):
                    return self._bad(key)
        except FileNotFoundError:
            self._forget(key)
            return False
        if zlib.crc32(view) != crc:
            return self._bad(key)
        os.utime(path)  # the LRU order survives a restart
        return True

    def _write(self, key: bytes, buf: memoryview) -> list[bytes]:
        """Write `key`'s page; the keys deleted to fit it."""
        data = memoryview(buf).cast("B")
        assert len(data) == self.page_bytes, f"a page of {len(data)} bytes, not {self.page_bytes}"
        path = self.path_of(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(self._tmp_ids)}.tmp")
        header = page_header(key, data)
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(data)
        os.replace(tmp, path)
        size = HEADER.size + len(data)
        with self._lock:
            if key not in self._lru:
                self._bytes += size
            self._lru[key] = size
            self._stats.pages_written += 1
            self._stats.bytes_written += len(data)
            victims = []
            while self._bytes > self.max_bytes and len(self._lru) > 1:
                victim, vsize = self._lru.popitem(last=False)
                self._bytes -= vsize
                victims.append(victim)
            self._stats.pages_evicted += len(victims)
        for victim in victims:
            self.path_of(victim).unlink(missing_ok=True)
        return victims

    def _adopt(self, key: bytes) -> bool:
        """Index `key`'s file if it exists (written by another process)."""
        try:
            size = self.path_of(key).stat().st_size
        except FileNotFoundError:
            return False
        with self._lock:
            if key not in self._lru:
                self._bytes += size
            self._lru[key] = size
        return True

    def _bad(self, key: bytes) -> bool:
        """A page that does not check: count it, delete it; a miss."""
        with self._lock:
            self._stats.corrupt += 1
        self._unlink(key)
        return False

    def _unlink(self, key: bytes) -> None:
        self._forget(key)
        self.path_of(key).unlink(missing_ok=True)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self._bytes -= size

    def _scan(self) -> None:
        """Index the pages already there (oldest modification first); temporary files of
        crashed writers go (another process may be writing the recent ones)."""
        found = []
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(".tmp"):
                    with contextlib.suppress(FileNotFoundError):
                        if time.time() - entry.stat().st_mtime > STALE_TMP_S:
                            Path(entry.path).unlink(missing_ok=True)
                    continue
                stem = entry.name.removesuffix(SUFFIX)
                if not entry.name.endswith(SUFFIX) or len(stem) != 2 * KEY_BYTES:
                    continue
                try:
                    key = bytes.fromhex(stem)
                    st = entry.stat()
                except (ValueError, FileNotFoundError):
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        for _, key, size in found:
            self._lru[key] = size
            self._bytes += size
