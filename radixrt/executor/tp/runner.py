"""TensorParallelRunner: rank 0's Runner. It starts the worker ranks, and for each step
broadcasts the plan to them and runs the same plan on its own shard.

Every rank samples the same tokens (same all-gathered logits, same seeded generator), so a
decode row's input token stays on every rank's device and overlap scheduling works as with
one rank. A failure (a worker exits, a collective errors or times out, a step does not
finish within `STEP_TIMEOUT_S`) leaves the ranks out of step: the runner then raises
TensorParallelError on this and every later call (the server answers 503 and exits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator

import torch

from radixrt.config import EngineConfig, ModelConfig
from radixrt.executor.result import PendingResult
from radixrt.executor.runner import ModelRunner
from radixrt.executor.tp.plan_codec import ControlKind, PlanEncoder
from radixrt.executor.tp.workers import TensorParallelError, WorkerArgs, WorkerSet
from radixrt.model.tp.group import TPGroup, create_store, set_nccl_env
from radixrt.plan import StepPlan, StepResult, SwapStats
from radixrt.tp_shard import check_devices, check_divisible

logger = logging.getLogger(__name__)

PLAN_CAPACITY = 1 << 14  # bytes of the first broadcast of a plan (longer plans need two)
STARTUP_TIMEOUT_S = 600.0  # workers must reach the process group by then
# A step's result must be on the host by then (CUDA); shorter than the collective timeout,
# whose NCCL watchdog would otherwise end the process first.
STEP_TIMEOUT_S = 90.0


def rank_device(device: str, rank: int) -> str:
    """cuda -> cuda:rank, cuda:i -> cuda:(i + rank), cpu -> cpu."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def check_tensor_parallel(cfg: EngineConfig, model_config: ModelConfig) -> None:
    """Raise ValueError when `cfg.tensor_parallel_size` does not fit the model or the
    devices present."""
    size = cfg.tensor_parallel_size
    check_divisible(model_config, size)
    if cfg.device.startswith("cuda"):
        check_devices(cfg.device, size, torch.cuda.device_count())


class TensorParallelRunner:
    def __init__(
        self, cfg: EngineConfig, model_config: ModelConfig, max_model_len: int, num_slots: int
    ) -> None:
        check_tensor_parallel(cfg, model_config)
        if torch.distributed.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialized in this process: one "
                "tensor-parallel engine per process (shut the previous one down first)"
            )
        size = cfg.tensor_parallel_size
        set_nccl_env()
        store = create_store(size)
        # On a CPU the ranks share the cores: each gets 1/size of rank 0's torch threads
        # (rank 0 too, until close(); oversubscribed OpenMP threads spin and stall the
        # collectives by orders of magnitude).
        self._cpu_threads_before = torch.get_num_threads()
        threads = max(1, self._cpu_threads_before // size)
        args = [
            WorkerArgs(
                cfg=dataclasses.replace(cfg, device=rank_device(cfg.device, rank)),
                model_config=model_config,
                max_model_len=max_model_len,
                num_slots=num_slots,
                rank=rank,
                size=size,
                store_port=store.port,
                cpu_threads=threads,
                log_level=logging.getLogger().getEffectiveLevel(),
            )
            for rank in range(1, size)
        ]
        self.size = size
        self.broken: str | None = None
        # CUDA: a dead rank's peers would hang in NCCL kernels; the process group's abort frees
        # them (a no-op before the group exists)
        abort = _abort_process_group if torch.device(cfg.device).type == "cuda" else None
        self.workers = WorkerSet(args, on_failure=abort)
        self.group: TPGroup | None = None
        try:
            self.workers.wait_started(STARTUP_TIMEOUT_S)
            device = torch.device(rank_device(cfg.device, 0))
            if device.type == "cuda":
                torch.cuda.set_device(device)
            else:
                torch.set_num_threads(threads)
            with self._watched("startup"):
                self.group = TPGroup(0, size, device, store)
                self.local = ModelRunner(
                    dataclasses.replace(cfg, device=str(device)),
                    model_config,
                    max_model_len,
                    num_slots,
                    tp=self.group,
                )
        except BaseException:
            self.workers.close(timeout_s=0)
            if self.group is not None:
                self.group.close()
            torch.set_num_threads(self._cpu_threads_before)
            raise
        self._store = store  # the rendezvous must outlive the group
        self._encoder = PlanEncoder()
        self.num_usable_blocks = self.local.num_usable_blocks
        self.num_host_blocks = 0  # no host tier under tensor parallelism (config refuses it)
        self.max_graph_tokens = self.local.max_graph_tokens
        self.last_send_s = 0.0  # time the last plan took to encode and broadcast
        logger.info("tensor parallelism: %d ranks on %s", size, cfg.device)

    # ---- Runner ----
    def execute(self, plan: StepPlan) -> _WatchedHandle:
        with self._watched(f"step {plan.step_id}"):
            start = time.perf_counter()
            self._send(self._encoder.encode(plan))
            self.last_send_s = time.perf_counter() - start
            handle = self.local.execute(plan)
        return _WatchedHandle(handle, self)

    def swap_stats(self) -> SwapStats:
        """All zero: no host tier under tensor parallelism."""
        return SwapStats()

    def check_health(self) -> None:
        """Raise TensorParallelError if a rank failed (cheap: no collective)."""
        if self.broken is None and self.workers.failure is not None:
            self.broken = self.workers.failure
        if self.broken is not None:
            raise TensorParallelError(self.broken)

    def compare_last_tokens(self) -> bool:
        """Whether every rank holds the same last sample in every slot. Ranks that sample
        differently corrupt each other's KV without an error, and their samples live in the
        worker processes, so only a message on the plan channel can check them: for tests
        and for diagnosing output that differs from one rank's."""
        with self._watched("compare"):
            self._send(self._encoder.control(ControlKind.COMPARE_LAST_TOKENS))
            assert self.group is not None
            copies = self.group.gather_host(self.local.last_tokens.cpu())
        return all(torch.equal(copies[0], c) for c in copies[1:])

    def close(self) -> None:
        """Stop the workers (STOP, then terminate stragglers) and leave the group."""
        if self.broken is None and self.workers.failure is None:
            try:
                self._send(self._encoder.control(ControlKind.STOP))
            except RuntimeError:
                logger.exception("could not tell the workers to stop; terminating them")
        self.workers.close()
        if self.group is not None:
            self.group.close()
            self.group = None
            torch.set_num_threads(self._cpu_threads_before)
        self.broken = self.broken or "the tensor-parallel runner is closed"

    # ---- internals ----
    def _send(self, data: bytearray) -> None:
        assert self.group is not None
        self.group.broadcast_bytes(data, PLAN_CAPACITY)

    @contextlib.contextmanager
    def _watched(self, what: str) -> Iterator[None]:
        """Fail fast if a rank is known dead; an exception inside breaks the runner (the
        ranks are out of step) and becomes TensorParallelError when a rank failed."""
        self.check_health()
        try:
            yield
        except BaseException as e:  # KeyboardInterrupt mid-step too: the ranks diverged
            failure = self.workers.wait_failure(1.0)
            self.broken = failure or f"{what} failed on rank 0: {e!r}"
            if failure is not None:
                raise TensorParallelError(failure) from e
            self.workers.close(timeout_s=0)
            raise
        self.check_health()

    def wait(self, handle: PendingResult) -> StepResult:
        """The step's result; on CUDA polls it so that a dead or hung rank ends the wait."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        pause = 2e-5
        while not handle.ready():
            self.check_health()
            if time.monotonic() > deadline:
                self.broken = f"a step did not finish within {STEP_TIMEOUT_S:.0f} s"
                self.workers.close(timeout_s=0)
                raise TensorParallelError(self.broken)
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        self.check_health()
        return handle.result()


@dataclasses.dataclass
class _WatchedHandle:
    handle: PendingResult
    runner: TensorParallelRunner

    def result(self) -> StepResult:
        return self.runner.wait(self.handle)


def _abort_process_group() -> None:
    """Abort NCCL communicators so that kernels waiting on a dead peer return."""
    import torch.distributed.distributed_c10d as c10d

    if c10d.is_initialized():
        c10d._abort_process_group()
