"""The processes of the front-capacity benchmark and one measured run through them.

`FrontRig` starts the front process (the real front and HTTP app; benchmarks.front_process)
with its fake scheduler (benchmarks.front_fake_scheduler), and P client processes
(benchmarks.front_clients); `run(RunConfig)` sends N streams through them at one step
interval and returns a `RunResult` (what was sent and received, ITL, CPU per token of the
front, the clients and the fake scheduler). Every received token is checked against what
the fake scheduler sent (`RunResult.errors`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import urllib.request
from collections.abc import Callable

import msgspec
import zmq

from benchmarks.front_boot import boot
from benchmarks.front_clients import ClientJob, ClientResult, client_main
from benchmarks.front_fake_scheduler import FakeSchedulerArgs, TokenSource
from benchmarks.front_process import FrontArgs, FrontStats
from benchmarks.front_profile import group_profile, top_functions
from benchmarks.front_results import FrontDelta, ProfileResult, RunConfig, RunResult, summarize

READY_TIMEOUT_S = 120.0
CONTROL_TIMEOUT_MS = 10_000
PROFILE_WAIT_S = 30.0


class FrontRig:
    """The front process (+ its fake scheduler) and `clients` client processes. Use as a
    context manager. `front_cpus` / `other_cpus` pin the front, and the fake scheduler and
    the clients (None: no pinning). `code_dir`: the front and the fake scheduler run that
    checkout's radixrt (None: this one's)."""

    def __init__(
        self,
        model: str,
        source: TokenSource,
        vocab_size: int,
        clients: int = 2,
        front_cpus: tuple[int, ...] | None = None,
        other_cpus: tuple[int, ...] | None = None,
        profile: bool = False,
        decode: Callable[[list[int]], str] | None = None,
        event_loop: str = "auto",
        code_dir: str | None = None,
    ) -> None:
        if clients < 1:
            raise ValueError(f"clients={clients}: need at least 1 client process")
        self.source = source
        self.decode = decode  # checks the received text too (tokenizer.decode)
        self.tmpdir = tempfile.mkdtemp(prefix="bench-front-")
        self.profile_path = os.path.join(self.tmpdir, "front.prof") if profile else None
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        control_addr = f"ipc://{self.tmpdir}/control"
        sched = FakeSchedulerArgs(source, vocab_size, control_addr, other_cpus, code_dir)
        ctx = multiprocessing.get_context("spawn")
        self.front_conn, front_end = ctx.Pipe()
        args = FrontArgs(model, self.port, sched, front_cpus, self.profile_path, event_loop)
        payload = pickle.dumps((args,))
        self.front = ctx.Process(
            target=boot,
            args=(code_dir, "benchmarks.front_process:front_main", payload, front_end),
            name="bench-front",
        )
        self.front.start()
        self.conns = []
        self.client_procs = []
        for _ in range(clients):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_main, args=(child, other_cpus), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.client_procs.append(proc)
        self.zmq = zmq.Context()
        self.control = self.zmq.socket(zmq.REQ)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.RCVTIMEO, CONTROL_TIMEOUT_MS)
        self.control.connect(control_addr)

    def __enter__(self) -> FrontRig:
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if not self.front.is_alive():
                raise RuntimeError(f"the front process exited with code {self.front.exitcode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the front at {self.url} was not ready in time")
            time.sleep(0.1)
        for conn in self.conns:
            assert conn.recv() == "ready"

    def _ask(self, msg: dict) -> dict:
        self.control.send(msgspec.msgpack.encode(msg))
        return msgspec.msgpack.decode(self.control.recv())

    def run(self, config: RunConfig) -> RunResult:
        """One measured run: N streams of max_tokens tokens at the step interval."""
        self._ask({"op": "configure", "interval_s": config.interval_s, "streams": config.streams})
        parts = [list(range(config.streams))[k :: len(self.conns)] for k in range(len(self.conns))]
        before, wait0 = self.front_stats(), proc_wait_s(self.front.pid)
        for conn, streams in zip(self.conns, parts):
            prompts = [self.source.prompt_ids(i) for i in streams]
            conn.send(
                ClientJob(
                    self.url, streams, prompts, config.max_tokens, config.route, config.parse,
                    list(config.stop),
                )
            )  # fmt: skip
        results: list[ClientResult] = [conn.recv() for conn in self.conns]
        after, front_wait = self.front_stats(), proc_wait_s(self.front.pid) - wait0
        stats = self._ask({"op": "stats"})
        front = FrontDelta.between(before, after, front_wait)
        return summarize(config, results, stats, front, self.source, self.decode)

    def front_stats(self) -> FrontStats:
        self.front_conn.send("stats")
        return self.front_conn.recv()

    def front_gc(self, mode: str) -> None:
        """ "freeze" (gc.freeze() now, after start-up) or "off" (gc.disable()) in the front."""
        if mode not in ("freeze", "off"):
            raise ValueError(f"gc mode {mode!r}: must be 'freeze' or 'off'")
        self.front_conn.send(f"gc_{mode}")
        self.front_conn.recv()

    def profile(self, config: RunConfig) -> ProfileResult:
        """`run(config)` without, then with the front's cProfile window open around it."""
        assert self.profile_path is not None, "FrontRig(profile=True) arms the profiler"
        baseline = self.run(config)
        os.kill(self.front.pid, signal.SIGUSR1)
        time.sleep(0.2)  # the handler runs once the front's loop wakes
        result = self.run(config)
        os.kill(self.front.pid, signal.SIGUSR2)
        deadline = time.monotonic() + PROFILE_WAIT_S
        while not os.path.exists(self.profile_path):
            if time.monotonic() > deadline:
                raise TimeoutError("the front wrote no profile")
            time.sleep(0.05)
        groups, top = group_profile(self.profile_path), top_functions(self.profile_path)
        return ProfileResult(result, baseline, groups, top)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        if self.front.is_alive():
            os.kill(self.front.pid, signal.SIGTERM)
        self.front.join(15)
        if self.front.is_alive():
            self.front.kill()
            self.front.join()
        for proc in self.client_procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.control.close()
        self.zmq.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def proc_wait_s(pid: int) -> float:
    """Seconds the threads of process `pid` were runnable but waited for a CPU (Linux
    /proc/PID/task/*/schedstat: run-queue wait; threads that ended are not counted)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended
    return total / 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
