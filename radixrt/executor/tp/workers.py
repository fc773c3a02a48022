"""Rank 0's side of the worker processes: start them, watch them, stop them.

Workers are plain subprocesses (`python -c ...`), not multiprocessing children: the server's
scheduler process is itself a daemonic multiprocessing child, which multiprocessing forbids to
have children. Each worker gets one end of a socket pair: rank 0 sends its `WorkerArgs`
there, the worker answers "hello" before it joins the process group and sends its traceback
if it fails. A watchdog thread waits on all pairs: end-of-file means the worker exited. An
exit that `close()` did not ask for is a failure: the other workers are terminated, the
`on_failure` callback runs (it aborts NCCL communicators, which would otherwise hang) and
`check()` raises TensorParallelError from then on. Detection does not depend on a collective
failing. The worker side watches the same pair and exits when rank 0 is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from radixrt.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)

TERMINATE_GRACE_S = 3.0  # SIGTERM, then SIGKILL after this
BOOT = "import sys; from radixrt.executor.tp.worker import main; main(int(sys.argv[1]))"


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, failed or hung: the engine cannot go on (restart it)."""


@dataclass(frozen=True)
class WorkerArgs:
    cfg: EngineConfig  # this rank's (its device)
    model_config: ModelConfig
    max_model_len: int
    num_slots: int
    rank: int
    size: int
    store_port: int
    cpu_threads: int  # torch threads on a CPU device
    log_level: int


class WorkerSet:
    def __init__(
        self, args: list[WorkerArgs], on_failure: Callable[[], None] | None = None
    ) -> None:
        """Start one process per entry of `args` (ranks 1..size-1) and the watchdog, which runs
        `on_failure` after the first failure (see the module docstring)."""
        self.ranks = [a.rank for a in args]
        self.procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._errors: dict[int, str] = {}  # rank -> traceback it sent
        self._hello: set[int] = set()
        self._cond = threading.Condition()
        self.failure: str | None = None
        self.on_failure = on_failure
        self._closing = False  # close() asked the workers to exit
        self._closed = False
        self._stop_r, self._stop_w = os.pipe()
        env = dict(os.environ)
        try:
            for a in args:
                ours, theirs = socket.socketpair()
                fd = theirs.fileno()
                proc = subprocess.Popen(
                    [sys.executable, "-c", BOOT, str(fd)],
                    pass_fds=(fd,),
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
                theirs.close()
                conn = Connection(ours.detach())
                self.procs.append(proc)
                self._conns.append(conn)
                conn.send(a)
        except BaseException:
            self._kill_all()
            raise
        self._thread = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._thread.start()

    # ---- rank 0 asks ----
    def wait_started(self, timeout_s: float) -> None:
        """Block until every worker said hello (it is about to join the process group);
        raises TensorParallelError when one exits first or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._hello) < len(self.ranks) and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(f"tensor-parallel workers did not start within {timeout_s:.0f} s")
                    break
                self._cond.wait(left)
        self.check()

    def check(self) -> None:
        """Raise TensorParallelError if a worker failed."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def wait_failure(self, timeout_s: float) -> str | None:
        """The failure, waiting up to `timeout_s` for the watchdog to see one."""
        with self._cond:
            self._cond.wait_for(lambda: self.failure is not None, timeout_s)
            return self.failure

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` for the workers to exit (they were told to), then
        terminate what is left; stops the watchdog. Idempotent."""
        if self._closed:
            return
        self._closed = self._closing = True
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker pid %d did not exit; terminating", proc.pid)
        self._kill_all()
        os.write(self._stop_w, b"x")
        self._thread.join()
        for conn in self._conns:
            conn.close()
        os.close(self._stop_r)
        os.close(self._stop_w)

    # ---- the watchdog ----
    def _watch(self) -> None:
        live = dict(zip(self._conns, zip(self.ranks, self.procs)))
        while live:
            ready = wait([*live, self._stop_r])
            if self._stop_r in ready:
                return
            for conn in ready:
                rank, proc = live[conn]
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    del live[conn]
                    self._exited(rank, proc)
                    continue
                with self._cond:
                    if kind == "hello":
                        self._hello.add(rank)
                    elif kind == "error":
                        self._errors[rank] = value
                    self._cond.notify_all()

    def _exited(self, rank: int, proc: subprocess.Popen) -> None:
        try:
            code = proc.wait(TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            code = None  # closed its end but lives on: treat as failed
        if self._closing and code == 0:
            return
        how = "closed its pipe" if code is None else _describe_exit(code)
        reason = f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"
        if rank in self._errors:
            reason += f":\n{self._errors[rank]}"
        if not self._closing:
            with self._cond:
                self._fail(reason)

    def _fail(self, reason: str) -> None:
        """Record the first failure, stop every worker, run `on_failure`. Holds _cond."""
        if self.failure is not None:
            return
        self.failure = reason
        logger.error("%s; stopping the tensor-parallel group", reason)
        self._cond.notify_all()
        self._kill_all()
        if self.on_failure is not None:
            try:
                self.on_failure()
            except Exception:
                logger.exception("aborting the process group failed")

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
