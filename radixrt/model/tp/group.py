"""The process groups of one tensor-parallel engine and the collectives the model uses.

Two groups over the same ranks, rendezvous through a TCPStore that rank 0 creates:
- the *model* group: NCCL on CUDA, gloo on a CPU; all-reduce after row-parallel layers,
  all-gather of vocabulary-parallel logits. Its timeout is bounded (`COLLECTIVE_TIMEOUT_S`).
- the *control* group: always gloo (CPU tensors): step plans from rank 0, startup
  agreement (KV pool size). Workers wait on it while the engine is idle, so its timeout is
  long; a dead rank 0 is noticed through the worker's pipe to its parent instead.

No multicast or symmetric-memory collectives are used; `set_nccl_env` disables them for
NCCL in this process and the ones it starts.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 120.0  # a model collective that takes longer ends the group
IDLE_TIMEOUT = datetime.timedelta(days=365)  # workers wait this long for the next plan
NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
STORE_HOST = "127.0.0.1"


def set_nccl_env(env: dict[str, str] | os._Environ = os.environ) -> None:
    """Disable NVLink multicast / symmetric memory in `env` where the user did not choose."""
    for key, value in NCCL_ENV.items():
        env.setdefault(key, value)


def create_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free local port (`store.port`)."""
    return dist.TCPStore(
        STORE_HOST,
        0,
        size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def connect_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(
        STORE_HOST,
        port,
        size,
        is_master=False,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


class TPGroup:
    """This process's rank in a tensor-parallel group of `size` ranks on `device`
    (cuda:i or cpu). One per process: it owns torch.distributed's default group."""

    def __init__(self, rank: int, size: int, device: torch.device, store: dist.Store) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialized in this process; one "
                "tensor-parallel engine per process (shut the previous one down first)"
            )
        self.rank = rank
        self.size = size
        self.device = device
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if device.type == "cuda":
            set_nccl_env()
            dist.init_process_group(
                "nccl", store=store, rank=rank, world_size=size, timeout=timeout, device_id=device
            )
        else:
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=size, timeout=timeout
            )
        self.model_group = dist.group.WORLD
        self.control_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    # ---- model collectives (device tensors) ----
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place; returns it."""
        dist.all_reduce(x, group=self.model_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[S, n] per rank -> [S, size * n]: rank r's columns at [r * n, (r + 1) * n)."""
        s, n = x.shape
        out = torch.empty((self.size * s, n), dtype=x.dtype, device=x.device)
        self._gather(out, x.contiguous(), group=self.model_group)
        return out.view(self.size, s, n).permute(1, 0, 2).reshape(s, self.size * n)

    # ---- control collectives (host values) ----
    def min_int(self, value: int) -> int:
        """The smallest `value` over ranks (every rank calls it)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def broadcast_bytes(self, data: bytearray | None, capacity: int) -> bytes | bytearray:
        """Rank 0 passes `data`, the others None; every rank returns rank 0's bytes. One
        broadcast of `capacity` bytes (8-byte length + payload), a second one for the rest
        of a longer payload."""
        head = torch.empty(capacity, dtype=torch.uint8)
        if self.rank == 0:
            assert data is not None
            n = len(data)
            head[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
            first = min(n, capacity - 8)
            if first:
                head[8 : 8 + first] = torch.frombuffer(data, dtype=torch.uint8, count=first)
            dist.broadcast(head, 0, group=self.control_group)
            if n > first:
                rest = torch.frombuffer(data, dtype=torch.uint8, offset=first)
                dist.broadcast(rest, 0, group=self.control_group)
            return data
        dist.broadcast(head, 0, group=self.control_group)
        n = int(head[:8].view(torch.int64)[0])
        first = min(n, capacity - 8)
        out = head[8 : 8 + first].numpy().tobytes()
        if n > first:
            rest = torch.empty(n - first, dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.control_group)
            out += rest.numpy().tobytes()
        return out

    def gather_host(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of host tensor `x` (same shape on every rank), rank order."""
        out = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(out, x, group=self.control_group)
        return out

    def close(self) -> None:
        """Leave the group (every process calls it once, at the end)."""
        if dist.is_initialized():
            dist.destroy_process_group()
