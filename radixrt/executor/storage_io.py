"""The storage tier's runner side: copies between the KV pools and a `StorageBackend`, on one
background thread.

- `StorePage` ops: the device blocks are copied, at once, into free staging pages (pinned on
  CUDA, on the host pool's copy stream after the work enqueued on the compute stream so far;
  the compute stream then waits for that copy, so no later forward rewrites a block before it
  is read), and the thread writes them. With every staging page busy the op is dropped and
  counted: writes never hold up the step loop.
- `StoreHostPage` ops (write-back of pages leaving the host tier): only pages whose
  write-through was dropped or failed (remembered, at most as many as the device and host
  pools hold) are copied out of the host block at once (after the copy stream's work so far
  on CUDA, so an earlier step's write-back into it is complete) and written like the others.
- `FetchPages` ops: the thread asks the backend which of the keys exist, reads the leading run
  into the named host blocks (the scheduler holds them) and reports a `FetchDone` with the
  seconds the lookup and the read took (the cost model's samples). Fetches go before queued
  writes. A fetch starts at the exchange after the one that brought it (on CUDA, once the
  copy stream's work enqueued by then is done): its host blocks were free when the scheduler
  took them, but the plan of that step may still copy into or out of them (a host copy
  evicted for the fetch after the same step queued its load).
- What the store holds, as far as this side sees it: a write that lands reports
  `PagesStored`, and the pages the backend deleted for room with it `PagesRemoved`; a fetch
  reports the keys it asked for and did not find whole as `PagesRemoved` (a store that evicts
  on its own, Redis, is seen only so). A write that fails, even in part, reports nothing.
`exchange(ops)` takes a step's ops and returns what finished since the last call, in the order
it happened; the engine calls it before every plan executes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import replace

import torch

from radixrt.cache.storage import (
    FetchDone,
    FetchPages,
    PagesRemoved,
    PagesStored,
    StorageBackend,
    StorageIOStats,
    StorageOp,
    StorageResult,
    StorageUnavailable,
    StoreHostPage,
    StorePage,
    leading_run,
)
from radixrt.kv.host_pool import HostKVPool

logger = logging.getLogger(__name__)


def weights_revision(model_path: str, load_format: str, seed: int) -> str:
    """What names the weights of `model_path` in page keys: dummy weights by their seed, a
    directory by the names, sizes and modification times of its files (a changed checkpoint
    gets new keys)."""
    if load_format == "dummy":
        return f"dummy:{seed}"
    h = hashlib.sha256()
    if os.path.isdir(model_path):
        for name in sorted(os.listdir(model_path)):
            st = os.stat(os.path.join(model_path, name))
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    else:
        st = os.stat(model_path)
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def page_view(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable, without a copy."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


class StorageIO:
    """See the module docstring."""

    def __init__(self, backend: StorageBackend, host_pool: HostKVPool, staging_pages: int) -> None:
        if staging_pages < 1:
            raise ValueError(f"kv_storage_write_queue must be >= 1, got {staging_pages}")
        self.backend = backend
        self.host_pool = host_pool
        kv = host_pool.kv  # [num_host_blocks, L, 2, B, H, D]
        assert backend.page_bytes == host_pool.bytes_per_block
        self._staging = torch.empty((staging_pages, *kv.shape[1:]), dtype=kv.dtype)
        if host_pool.is_cuda:
            self._staging = self._staging.pin_memory()
        self._free = list(range(staging_pages))
        # keys whose write-through was dropped or failed, oldest first (write-back's to-do)
        self._unwritten: OrderedDict[bytes, None] = OrderedDict()
        self._max_unwritten = host_pool.num_blocks + host_pool.device_pool.num_blocks
        self._stats = StorageIOStats()
        self._cond = threading.Condition()
        self._fetches: deque[tuple[FetchPages, torch.cuda.Event | None]] = deque()
        self._deferred: list[FetchPages] = []  # the last exchange's fetches: they wait one
        self._writes: deque[tuple[list[bytes], list[int], torch.cuda.Event | None]] = deque()
        self._done: list[StorageResult] = []
        self._fetches_done = 0  # FetchDone in `_done`
        self._closed = False
        self._busy = False
        self._fetching = False  # the thread is reading a fetch
        self._thread = threading.Thread(target=self._work, name="kv-storage", daemon=True)
        self._thread.start()

    def exchange(self, ops: list[StorageOp]) -> list[StorageResult]:
        """Start `ops` (see the module docstring); what finished since the last call, in
        order."""
        stores = [op for op in ops if isinstance(op, StorePage)]
        if stores:
            self._stage(stores)
        evicted = [op for op in ops if isinstance(op, StoreHostPage)]
        if evicted:
            self._stage_evicted(evicted)
        fetches, self._deferred = self._deferred, [op for op in ops if isinstance(op, FetchPages)]
        event = None
        if fetches and self.host_pool.is_cuda:  # the swap copies enqueued so far end first
            event = torch.cuda.Event()
            event.record(self.host_pool.stream)
        with self._cond:
            self._fetches.extend((op, event) for op in fetches)
            if fetches:
                self._cond.notify()
            done, self._done = self._done, []
            self._fetches_done = 0
        return done

    def stats(self) -> StorageIOStats:
        with self._cond:
            return replace(self._stats, backend=self.backend.stats())

    def wait_for_fetch(self, timeout_s: float) -> None:
        """Block until a fetch has finished since the last `exchange`, at most `timeout_s`
        (the step loop's idle wait: it sleeps instead of spinning, so this thread is not
        starved of the GIL)."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._fetches_done or not self._fetches_pending(), timeout_s
            )

    def _fetches_pending(self) -> bool:
        """Caller holds `_cond`: fetches queued or being read."""
        return bool(self._fetches) or self._fetching

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until the queued work is done (tests; shutdown)."""
        with self._cond:
            self._cond.wait_for(
                lambda: not (self._fetches or self._writes or self._busy), timeout_s
            )

    def close(self) -> None:
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self.backend.close()

    def _take_slots(self, keys: list[bytes]) -> list[int]:
        """Free staging pages for the first of `keys`; the rest are dropped (counted, and
        remembered for write-back)."""
        with self._cond:
            slots = [self._free.pop() for _ in range(min(len(self._free), len(keys)))]
            self._stats.write_drops += len(keys) - len(slots)
            self._remember_unwritten(keys[len(slots) :])
        return slots

    def _remember_unwritten(self, keys: list[bytes]) -> None:
        """Caller holds `_cond`."""
        for key in keys:
            self._unwritten[key] = None
            self._unwritten.move_to_end(key)
        while len(self._unwritten) > self._max_unwritten:
            self._unwritten.popitem(last=False)

    def _stage(self, stores: list[StorePage]) -> None:
        slots = self._take_slots([op.key for op in stores])
        if not slots:
            return
        with self._cond:
            self._stats.pages_queued += len(slots)
        stores = stores[: len(slots)]
        kv = self.host_pool.device_pool.kv  # [L, 2, num_blocks, B, H, D]
        raw = kv.view(torch.uint8) if kv.element_size() == 1 else kv
        staging = self._staging.view(torch.uint8) if kv.element_size() == 1 else self._staging
        event = None
        if self.host_pool.is_cuda:
            compute = torch.cuda.current_stream()
            stream = self.host_pool.stream
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                self._copy_out(raw, staging, stores, slots)
                event = torch.cuda.Event()
                event.record()
            compute.wait_event(event)
        else:
            self._copy_out(raw, staging, stores, slots)
        with self._cond:
            self._writes.append(([op.key for op in stores], slots, event))
            self._cond.notify()

    def _stage_evicted(self, evicted: list[StoreHostPage]) -> None:
        """Write-back of the evicted host pages whose write-through did not land."""
        with self._cond:
            todo = [op for op in evicted if op.key in self._unwritten]
            for op in todo:
                del self._unwritten[op.key]
            slots = [self._free.pop() for _ in range(min(len(self._free), len(todo)))]
            self._stats.write_drops += len(todo) - len(slots)  # the block is gone after this
            self._stats.pages_written_back += len(slots)
        if not slots:
            return
        if self.host_pool.is_cuda:
            self.host_pool.stream.synchronize()  # earlier steps' write-backs into these blocks
        kv = self.host_pool.kv  # [num_host_blocks, L, 2, B, H, D]
        one_byte = kv.element_size() == 1
        raw = kv.view(torch.uint8) if one_byte else kv
        staging = self._staging.view(torch.uint8) if one_byte else self._staging
        for op, slot in zip(todo, slots):
            staging[slot].copy_(raw[op.host_block])
        with self._cond:
            self._writes.append(([op.key for op in todo[: len(slots)]], slots, None))
            self._cond.notify()

    @staticmethod
    def _copy_out(
        raw: torch.Tensor, staging: torch.Tensor, stores: list[StorePage], slots: list[int]
    ) -> None:
        idx = torch.tensor([op.device_block for op in stores], dtype=torch.int64)
        pages = raw.index_select(2, idx.to(raw.device)).permute(2, 0, 1, 3, 4, 5)
        for i, slot in enumerate(slots):
            staging[slot].copy_(pages[i], non_blocking=True)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._fetches or self._writes or self._closed)
                if self._closed and not (self._fetches or self._writes):
                    return
                fetch = self._fetches.popleft() if self._fetches else None
                write = self._writes.popleft() if fetch is None else None
                self._busy = True
                self._fetching = fetch is not None
            try:
                if fetch is not None:
                    done, missing = self._fetch(*fetch)
                    with self._cond:
                        if missing:
                            self._done.append(PagesRemoved(tuple(missing)))
                        self._done.append(done)
                        self._fetches_done += 1
                else:
                    self._write(*write)
            finally:
                with self._cond:
                    self._busy = False
                    self._fetching = False
                    self._cond.notify_all()

    def _fetch(self, op: FetchPages, event) -> tuple[FetchDone, list[bytes]]:
        """The fetch's result, and the keys it found absent or unreadable."""
        lookup_s = read_s = 0.0
        missing: list[bytes] = []
        if event is not None:
            event.synchronize()
        try:
            t0 = time.perf_counter()
            found = self.backend.exists(op.keys)
            t1 = time.perf_counter()
            lookup_s = t1 - t0
            num = leading_run(found)
            kv = self.host_pool.kv
            views = [page_view(kv[h]) for h in op.host_blocks[:num]]
            read = self.backend.get(op.keys[:num], views) if num else []
            read_s = time.perf_counter() - t1
            num = leading_run(read)
            missing = [k for k, ok in zip(op.keys, found) if not ok]
            missing += [k for k, ok in zip(op.keys, read) if not ok]
        except StorageUnavailable as e:  # the backend logs its outages
            logger.debug("kv storage: a fetch of %d pages failed: %s", len(op.keys), e)
            with self._cond:
                self._stats.fetch_errors += 1
            num = 0
        except Exception:  # a failing store is a miss: the request computes instead
            logger.exception("kv storage: a fetch of %d pages failed", len(op.keys))
            with self._cond:
                self._stats.fetch_errors += 1
            num = 0
        return FetchDone(op.ticket, num, self.backend.page_bytes, lookup_s, read_s), missing

    def _write(self, keys: list[bytes], slots: list[int], event) -> None:
        if event is not None:
            event.synchronize()
        deleted: list[bytes] = []
        try:
            deleted = self.backend.set(keys, [page_view(self._staging[s]) for s in slots])
            ok = True
        except StorageUnavailable as e:  # the backend logs its outages
            logger.debug("kv storage: a write of %d pages failed: %s", len(keys), e)
            ok = False
        except Exception:  # a failing store loses the pages, never a request
            logger.exception("kv storage: a write of %d pages failed", len(keys))
            ok = False
        with self._cond:
            self._free += slots
            if ok:
                for key in keys:
                    self._unwritten.pop(key, None)
                self._done.append(PagesStored(tuple(keys)))
                if deleted:
                    self._done.append(PagesRemoved(tuple(deleted)))
            else:
                self._stats.write_errors += len(keys)
                self._remember_unwritten(keys)
