"""The host KV tier's memory and its transfers (runner side).

`HostKVPool` holds `kv[host_block, layer, 0 | 1, offset, kv_head, head_dim]` (block-major, so
a host block is one contiguous run; pinned when the device is CUDA) and executes a plan's
SwapOut / SwapIn ops against the device `KVPool`.

Ordering contract (CUDA), per step, decided here once:
- The ops run at the start of the step, in plan order, on one copy stream that first waits
  for everything enqueued on the compute stream so far (earlier steps' KV writes are done
  before a write-back reads them; earlier steps' reads of a block are done before a load
  overwrites it). Ops of different steps keep plan order on that one stream, so a host block
  is never rewritten before an earlier load read it.
- The step's forward waits for the step's copies when one of its rows (or copies) reads a
  block the step loads, or it writes a device block that one of its write-backs reads (a
  block freed by a write-back and reused at once). Otherwise only the next step's forward
  waits for them, so transfers overlap this step's compute. The scheduler plans a request
  whose prefix loads from the host without a row in that step when other rows run (its first
  row comes with the next plan): those rows do not wait for its transfer.
- The scheduler frees a written-back device block at once (no block is "in flight" for its
  allocator): a later step reusing it runs after that wait, a later load into it
  runs after the write-back on the copy stream: the fence lives here.
On a CPU the copies are synchronous and nothing waits.
"""

from __future__ import annotations

import logging
import time
import weakref

import numpy as np
import torch

from radixrt.kv.pool import KVPool
from radixrt.plan import SwapIn, SwapOut, SwapStats

logger = logging.getLogger(__name__)

CHUNK_BLOCKS = 64  # blocks per device staging buffer (bounds its memory)


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (psutil if installed), or None when unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def num_host_blocks(host_kv_gb: float, explicit: int | None, bytes_per_block: int) -> int:
    """Host pool size in blocks; ValueError when it does not fit in available memory."""
    num = explicit if explicit is not None else int(host_kv_gb * 2**30 // bytes_per_block)
    if num < 1:
        raise ValueError(
            f"host_kv_gb={host_kv_gb} holds no KV block of {bytes_per_block} bytes; raise it"
        )
    need, avail = num * bytes_per_block, mem_available_bytes()
    if avail is not None and need > avail:
        raise ValueError(
            f"host KV tier of {need / 2**30:.1f} GiB ({num} blocks) exceeds the "
            f"{avail / 2**30:.1f} GiB of available host memory; lower host_kv_gb"
        )
    return num


class HostKVPool:
    """See the module docstring. `device_pool` is the runner's KVPool."""

    def __init__(self, num_blocks: int, device_pool: KVPool) -> None:
        self.num_blocks = num_blocks
        self.device_pool = device_pool
        dev_kv = device_pool.kv  # [L, 2, num_blocks, B, H, D]
        self.is_cuda = dev_kv.device.type == "cuda"
        shape = (num_blocks, *dev_kv.shape[:2], *dev_kv.shape[3:])
        start = time.perf_counter()
        # [num_host_blocks, L, 2, B, H, D], page-locked on CUDA (async copies)
        self.kv = torch.empty(shape, dtype=dev_kv.dtype)
        if self.is_cuda:
            _pin(self)
        self.bytes_per_block = self.kv[0].numel() * self.kv.element_size()
        logger.info(
            "host KV pool: %d blocks (%.1f GiB%s) in %.1f s",
            num_blocks,
            num_blocks * self.bytes_per_block / 2**30,
            ", pinned" if self.is_cuda else "",
            time.perf_counter() - start,
        )
        self.stream = torch.cuda.Stream(dev_kv.device) if self.is_cuda else None
        self._stats = SwapStats()
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._done: torch.cuda.Event | None = None  # the last step's copies

    def stats(self) -> SwapStats:
        """Totals so far (CUDA: transfers whose events completed)."""
        pending = []
        for begin, end in self._timed:
            if end.query():
                self._stats.seconds += begin.elapsed_time(end) / 1e3
            else:
                pending.append((begin, end))
        self._timed = pending
        return self._stats

    def wait_previous(self) -> None:
        """Make the compute stream wait for the previous step's copies (call before the
        forward of every step)."""
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
            self._done = None

    def execute(self, ops: list[SwapIn | SwapOut], read: set[int], written: set[int]) -> None:
        """Run the step's swap ops in order (see the module docstring); `read` / `written`:
        device blocks the step's forward and copies read / write. Call `wait_previous`
        first."""
        outs = [op for op in ops if isinstance(op, SwapOut)]
        ins = [op for op in ops if isinstance(op, SwapIn)]
        s = self._stats
        s.blocks_out += len(outs)
        s.blocks_in += len(ins)
        s.bytes_out += len(outs) * self.bytes_per_block
        s.bytes_in += len(ins) * self.bytes_per_block
        if not self.is_cuda:
            start = time.perf_counter()
            self._run(ops)
            s.seconds += time.perf_counter() - start
            return
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            begin.record()
            self._run(ops)
            end.record()
        self._timed.append((begin, end))
        if len(self._timed) > 64:
            self.stats()  # fold finished timings in
        if any(op.device_block in read for op in ins) or any(
            op.device_block in written for op in outs
        ):
            compute.wait_event(end)
        else:
            self._done = end  # the next step's forward waits (wait_previous)

    def _run(self, ops: list[SwapIn | SwapOut]) -> None:
        """Consecutive ops of one kind run as batches of up to CHUNK_BLOCKS blocks."""
        i = 0
        while i < len(ops):
            kind = type(ops[i])
            j = i
            while j < len(ops) and type(ops[j]) is kind and j - i < CHUNK_BLOCKS:
                j += 1
            if kind is SwapOut:
                self._write_back(
                    [op.device_block for op in ops[i:j]], [op.host_block for op in ops[i:j]]
                )
            else:
                self._load([op.host_block for op in ops[i:j]], [op.device_block for op in ops[i:j]])
            i = j

    def _write_back(self, dev: list[int], host: list[int]) -> None:
        kv = _raw(self.device_pool.kv)
        idx = torch.tensor(dev, dtype=torch.int64).to(kv.device, non_blocking=True)
        # [n, L, 2, B, H, D] contiguous on the device, then one copy per run of host ids
        staged = kv.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()
        host_kv = _raw(self.kv)
        for a, b, h in _runs(host):
            host_kv[h : h + b - a].copy_(staged[a:b], non_blocking=True)

    def _load(self, host: list[int], dev: list[int]) -> None:
        kv, host_kv = _raw(self.device_pool.kv), _raw(self.kv)
        staged = torch.empty((len(host), *host_kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        for a, b, h in _runs(host):
            staged[a:b].copy_(host_kv[h : h + b - a], non_blocking=True)
        idx = torch.tensor(dev, dtype=torch.int64).to(kv.device, non_blocking=True)
        kv.index_copy_(2, idx, staged.permute(1, 2, 0, 3, 4, 5))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """One-byte dtypes (fp8 KV) as uint8: index_select / index_copy_ need not support them."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _pin(pool: HostKVPool) -> None:
    """Page-lock `pool.kv` in place (cudaHostRegister: torch's pinned allocator would round
    the size up to a power of two); unregistered when the pool is collected."""
    t = pool.kv
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 1)  # cudaHostRegisterPortable
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the {nbytes / 2**30:.1f} GiB host KV pool: {err}")
    weakref.finalize(pool, cudart.cudaHostUnregister, ptr)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(a, b, first id) for each maximal run ids[a:b] of consecutive ids."""
    out = []
    a = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or ids[k] != ids[k - 1] + 1:
            out.append((a, k, ids[a]))
            a = k
    return out


def blocks_touched(
    plan_rows, block_tables: np.ndarray, block_size: int
) -> tuple[set[int], set[int]]:
    """Device blocks the rows of a step read (their whole KV) and write (their new tokens),
    from the slots' block tables after the step's updates."""
    read: set[int] = set()
    written: set[int] = set()
    for r in plan_rows:
        lo, hi = r.start // block_size, (r.end - 1) // block_size + 1
        read.update(block_tables[r.slot, :hi].tolist())
        written.update(block_tables[r.slot, lo:hi].tolist())
    return read, written
