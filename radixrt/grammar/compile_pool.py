"""Grammar compiles in worker processes that are killed when a compile runs too long.

A compile cannot be interrupted inside xgrammar, and a thread that runs one cannot be
stopped: a few slow grammars would hold every compile thread for minutes. Here each compile
runs in a worker process (`radixrt.grammar.compile_worker`); a manager thread of the parent
hands queued jobs to idle workers and

- kills a worker whose job has run `time_limit_s` in total: the job fails with the time
  limit (a 400), and a fresh worker takes its place;
- preempts the longest-running compile when jobs wait, every compile slot is busy and that
  compile has run at least `slice_s` longer than the job at the head of the queue has: its
  worker is killed and the job goes back to the queue with the time it has run. The queue is
  ordered by time run so far (least first, then arrival), so a new grammar waits about
  `slice_s` whatever slow compiles are in flight, while a slow job keeps its place in line
  and fails once its total reaches the limit.

`num_workers` compiles run at once, each in a worker forked from one template process that
loaded the tokenizer (`radixrt.grammar.compile_worker`): replacing a killed worker takes
milliseconds, not the seconds of a fresh interpreter importing xgrammar.
Waiting for a worker does not count toward the limit. Compiled grammars come back as
xgrammar's serialized JSON (`CompiledGrammar.serialize_json`); `decode` turns them into the
futures' results on the manager thread. A template that cannot start (no tokenizer) or dies
fails the pool: every job then fails as an internal error.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from radixrt.grammar.compile_worker import (
    BOOT,
    FORK,
    CompileError,
    Reply,
    SetupFailed,
    TemplateReady,
    WorkerSetup,
)
from radixrt.grammar.spec import GrammarSpec

logger = logging.getLogger(__name__)

PREEMPT_SLICE_S = 1.0  # a compile that ran this much longer than the queue's head may yield


class InternalCompileError(RuntimeError):
    """A compile failed on the engine's side (a worker crashed, the template cannot start)."""


@dataclass(order=True)
class _Job:
    attained_s: float  # compile time spent on it so far (by earlier, preempted runs)
    seq: int  # arrival order among equal times
    spec: GrammarSpec = field(compare=False)
    future: Future = field(compare=False)


@dataclass(eq=False)
class _Worker:
    pid: int  # a child of the template process (which reaps it)
    conn: Connection
    job: _Job | None = None  # running, since `started`
    started: float = 0.0


@dataclass(slots=True)
class PoolStats:
    num_timeouts: int = 0  # compiles killed at the time limit
    num_preemptions: int = 0  # compiles killed to let a waiting one run (then requeued)


@dataclass(frozen=True, slots=True)
class PoolProcesses:
    template: int | None  # pid of the template process; None before it starts
    idle: tuple[int, ...]  # pids of workers without a compile
    busy: tuple[int, ...]  # pids of workers running a compile


class CompilePool:
    """See the module docstring. `submit` may be called from any thread; the futures are
    resolved on the manager thread (with `decode`'s result, or CompileError for the
    request's fault, or InternalCompileError)."""

    def __init__(
        self,
        setup: WorkerSetup,
        num_workers: int,
        time_limit_s: float,
        decode: Callable[[TemplateReady, GrammarSpec, str], Any],
        slice_s: float = PREEMPT_SLICE_S,
    ) -> None:
        assert num_workers >= 1 and time_limit_s > 0
        self.setup = setup
        self.num_workers = num_workers
        self.time_limit_s = time_limit_s
        self.slice_s = slice_s
        self.decode = decode
        self.stats = PoolStats()
        self.ready: TemplateReady | None = None  # the template's, once it has loaded the tokenizer
        self.failure: str | None = None  # the template failed: every job fails
        self._queue: list[_Job] = []  # heap, guarded by _lock
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._workers: list[_Worker] = []  # the manager thread's
        self._template: subprocess.Popen | None = None
        self._template_conn: Connection | None = None
        self._template_sock: socket.socket | None = None
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="grammar-pool", daemon=True)
        self._thread.start()

    def submit(self, spec: GrammarSpec) -> Future:
        future: Future = Future()
        with self._lock:
            heapq.heappush(self._queue, _Job(0.0, next(self._seq), spec, future))
        os.write(self._wake_w, b"x")
        return future

    def close(self) -> None:
        """Kill the workers, stop the manager; queued jobs are cancelled. Idempotent."""
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def processes(self) -> PoolProcesses:
        """The pool's live processes, so that reliability checks can kill a busy worker
        from outside (the crash path) and see every process gone after `close`. A snapshot
        of the manager thread's state: it may be one step behind."""
        workers = list(self._workers)
        template = self._template
        return PoolProcesses(
            template=None if template is None else template.pid,
            idle=tuple(w.pid for w in workers if w.job is None),
            busy=tuple(w.pid for w in workers if w.job is not None),
        )

    # ---- the manager thread ----
    def _run(self) -> None:
        try:
            while not self._closed:
                self._step()
        except Exception:  # a bug here would leave every request waiting: fail them all
            logger.exception("the grammar compile pool failed")
            self._fail_pool("the grammar compile pool failed (see the server log)")
        finally:
            pids = [w.pid for w in self._workers]
            for w in list(self._workers):
                self._kill(w)
            _wait_gone(pids, timeout_s=2.0)  # reaped by the template while it lives
            self._stop_template()
            with self._lock:
                jobs, self._queue = self._queue, []
            for job in jobs:
                job.future.cancel()

    def _step(self) -> None:
        if self.failure is not None:
            self._fail_pool(self.failure)  # jobs submitted since
        if self.failure is None and self._template is None:
            self._start_template()
        while self.failure is None and self.ready and len(self._workers) < self.num_workers:
            self._fork_worker()
        self._dispatch()
        timeout = self._enforce_limits()
        conns = {w.conn: w for w in self._workers}
        template = [] if self._template_conn is None else [self._template_conn]
        for ready in wait([*conns, *template, self._wake_r], timeout):
            if ready == self._wake_r:
                os.read(self._wake_r, 4096)
            elif ready in conns:
                self._receive(conns[ready])
            else:
                self._template_message()

    def _dispatch(self) -> None:
        for w in list(self._workers):
            if w.job is None:
                with self._lock:
                    if not self._queue:
                        return
                    job = heapq.heappop(self._queue)
                if job.future.done():  # cancelled by close()
                    continue
                try:
                    w.conn.send((job.seq, job.spec))
                except OSError:  # the worker died idle: the job waits for its replacement
                    with self._lock:
                        heapq.heappush(self._queue, job)
                    self._exited(w)
                    continue
                w.job, w.started = job, time.monotonic()

    def _enforce_limits(self) -> float:
        """Kill compiles over the limit, preempt one if a job waits; the seconds until the
        next compile reaches its limit or slice (the manager's wait), 0 after a kill."""
        now = time.monotonic()
        busy = [w for w in self._workers if w.job is not None]
        killed = False
        for w in busy:
            job = w.job
            assert job is not None
            if job.attained_s + now - w.started >= self.time_limit_s:
                self.stats.num_timeouts += 1
                killed = True
                self._kill(w)
                job.future.set_exception(
                    CompileError(
                        f"compiling the {job.spec.field} took longer than "
                        f"{self.time_limit_s:g} s (the time limit)"
                    )
                )
        busy = [w for w in self._workers if w.job is not None]
        with self._lock:
            head = self._queue[0] if self._queue else None
        if head is not None and len(busy) >= self.num_workers:
            w = max(busy, key=lambda w: w.job.attained_s + now - w.started)
            ran = now - w.started
            if ran >= self.slice_s and w.job.attained_s + ran >= head.attained_s + self.slice_s:
                job = w.job
                self.stats.num_preemptions += 1
                self._kill(w)
                job.attained_s += ran
                with self._lock:
                    heapq.heappush(self._queue, job)
                killed = True
        if killed:
            return 0.0  # fork a replacement and hand it the queue's head now
        next_event = [self.time_limit_s - w.job.attained_s - (now - w.started) for w in busy]
        if head is not None:
            next_event += [self.slice_s - (now - w.started) for w in busy]
        return max(0.001, min(next_event, default=1.0))

    def _receive(self, w: _Worker) -> None:
        try:
            reply = w.conn.recv()
        except (EOFError, OSError):
            self._exited(w)
            return
        assert isinstance(reply, Reply) and w.job is not None and reply.job_id == w.job.seq
        job, w.job = w.job, None
        self._resolve(job, reply)

    def _template_message(self) -> None:
        """TemplateReady or SetupFailed; end-of-file: the template died."""
        assert self._template_conn is not None
        try:
            msg = self._template_conn.recv()
        except (EOFError, OSError):
            code = self._stop_template()
            logger.error("the grammar compiler exited (%s): constrained requests get 503", code)
            self._fail_pool(f"internal error: the grammar compiler exited ({code})")
            return
        if isinstance(msg, TemplateReady):
            self.ready = msg
        else:
            assert isinstance(msg, SetupFailed), msg
            logger.error("the grammar compiler could not start:\n%s", msg.traceback)
            self._stop_template()
            last = msg.traceback.strip().splitlines()[-1]
            self._fail_pool(f"internal error: the grammar compiler cannot start ({last})")

    def _resolve(self, job: _Job, reply: Reply) -> None:
        if reply.error is not None:
            error_type = InternalCompileError if reply.internal else CompileError
            job.future.set_exception(error_type(reply.error))
            return
        assert self.ready is not None and reply.grammar_json is not None
        try:
            value = self.decode(self.ready, job.spec, reply.grammar_json)
        except Exception as e:
            logger.exception("decoding a compiled %s failed", job.spec.kind)
            job.future.set_exception(InternalCompileError(f"internal error: {e!r}"))
            return
        job.future.set_result(value)

    def _exited(self, w: _Worker) -> None:
        """A worker that we did not kill exited (it crashed, or was killed from outside)."""
        self._workers.remove(w)
        w.conn.close()
        if w.job is not None:
            logger.error("grammar compile worker %d exited compiling a %s", w.pid, w.job.spec.kind)
            w.job.future.set_exception(
                InternalCompileError(f"internal error: the {w.job.spec.field} compile crashed")
            )

    def _fail_pool(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
        with self._lock:
            jobs, self._queue = self._queue, []
        for w in list(self._workers):
            if w.job is not None:
                jobs.append(w.job)
            self._kill(w)
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(InternalCompileError(message))

    def _start_template(self) -> None:
        env = dict(os.environ)
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        self._template = subprocess.Popen(
            [sys.executable, "-c", BOOT, str(fd)], pass_fds=(fd,), env=env,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        self._template_sock = ours
        self._template_conn = Connection(os.dup(ours.fileno()))
        self._template_conn.send(self.setup)

    def _fork_worker(self) -> None:
        """Ask the template for a worker: its pid, then our end of its socket (SCM_RIGHTS)."""
        assert self._template_conn is not None and self._template_sock is not None
        try:
            self._template_conn.send(FORK)
            pid = self._template_conn.recv()
            _, fds, _, _ = socket.recv_fds(self._template_sock, 1, 1)
        except (EOFError, OSError):
            code = self._stop_template()
            self._fail_pool(f"internal error: the grammar compiler exited ({code})")
            return
        assert isinstance(pid, int) and len(fds) == 1, (pid, fds)
        self._workers.append(_Worker(pid, Connection(fds[0])))

    def _stop_template(self) -> int | None:
        """Kill the template (if running); its exit code."""
        if self._template is None:
            return None
        self._template.kill()
        code = self._template.wait()
        for closable in (self._template_conn, self._template_sock):
            if closable is not None:
                closable.close()
        self._template_conn = self._template_sock = None
        return code

    def _kill(self, w: _Worker) -> None:
        """Stop `w` now (its job, if any, is the caller's to settle)."""
        with contextlib.suppress(ProcessLookupError):  # it exited on its own (reaped)
            os.kill(w.pid, signal.SIGKILL)
        w.conn.close()
        if w in self._workers:
            self._workers.remove(w)


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    """Wait until these killed processes are gone (reaped), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.005)
