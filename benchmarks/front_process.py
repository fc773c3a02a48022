"""The front process of the front-capacity benchmark: the REAL front and HTTP app, served
by `radixrt.server.launch.serve` (as `radixrt serve` does), with the fake scheduler process
of benchmarks.front_fake_scheduler in place of the real one.

Optional: pinned to given CPUs (before any thread starts, so the ZMQ I/O thread and the
tokenizer's threads are pinned too), and a cProfile window that the parent opens with
SIGUSR1 and closes with SIGUSR2 (the stats go to `profile_path`, written atomically).

A control thread (blocked on its pipe, so it costs nothing while the front runs) answers
"stats" with `FrontStats` (this process's own CPU clock, getrusage, and its garbage
collector's pauses, timed by gc.callbacks) and applies "gc_freeze" / "gc_off" (what a
fixed front might do, to measure it before it is written).
"""

from __future__ import annotations

import cProfile
import functools
import gc
import logging
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from benchmarks.front_fake_scheduler import FakeSchedulerArgs, start_fake_scheduler


@dataclass(frozen=True)
class FrontArgs:
    model: str  # the tokenizer's model dir
    port: int
    scheduler: FakeSchedulerArgs
    cpus: tuple[int, ...] | None = None  # sched_setaffinity of the front (None: any)
    profile_path: str | None = None  # arm the SIGUSR1/SIGUSR2 cProfile window
    event_loop: str = "auto"  # ServeConfig.event_loop: auto (uvloop when installed) | ...


@dataclass(frozen=True)
class FrontStats:
    """Cumulative since the front started, except `gc_max_pause_s`."""

    cpu_s: float  # getrusage(RUSAGE_SELF): user + system, every thread
    gc_collections: tuple[int, int, int]  # per generation
    gc_pause_s: float  # total time in the collector
    gc_max_pause_s: float  # the longest pause since the previous "stats"


class _GcTimer:
    """Times every collection (gc.callbacks)."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.pause_s = 0.0
        self.max_pause_s = 0.0
        self._start = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        self.collections[info["generation"]] += 1
        self.pause_s += pause
        self.max_pause_s = max(self.max_pause_s, pause)


def front_main(args: FrontArgs, control: Connection | None = None) -> None:
    """Serve until SIGTERM; `control`: the control thread's end of a pipe."""
    if args.cpus is not None:
        os.sched_setaffinity(0, args.cpus)
    logging.basicConfig(level="WARNING", format="%(asctime)s front %(levelname)s %(message)s")
    if args.profile_path is not None:
        _arm_profiler(args.profile_path)
    if control is not None:
        threading.Thread(
            target=_serve_control, args=(control, _GcTimer()), name="bench-control",
            daemon=True,
        ).start()  # fmt: skip
    from radixrt.server.launch import ServeConfig, serve

    # event_loop only when asked: a front from before the option still runs (A/B runs)
    options = {} if args.event_loop == "auto" else {"event_loop": args.event_loop}
    # /generate streams deltas (the clients count every id once), as fronts before the
    # option did by default
    if "incremental_streaming" in ServeConfig.__dataclass_fields__:
        options["incremental_streaming"] = True
    cfg = ServeConfig(model=args.model, port=args.port, device="cpu", dtype="float32", **options)
    code = serve(cfg, start_scheduler=functools.partial(start_fake_scheduler, args.scheduler))
    raise SystemExit(code)


def _serve_control(conn: Connection, timer: _GcTimer) -> None:
    while True:
        try:
            op = conn.recv()
        except EOFError:  # the benchmark process is gone: stop serving, as on SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if op == "stats":
            ru, c = resource.getrusage(resource.RUSAGE_SELF), timer.collections
            cpu = ru.ru_utime + ru.ru_stime
            stats = FrontStats(cpu, (c[0], c[1], c[2]), timer.pause_s, timer.max_pause_s)
            timer.max_pause_s = 0.0
            conn.send(stats)
        elif op == "gc_freeze":
            gc.freeze()  # what exists now is never collected (nor scanned) again
            conn.send(None)
        else:
            assert op == "gc_off", op
            gc.disable()
            conn.send(None)


def _arm_profiler(path: str) -> None:
    """cProfile's own (wall) clock: its overhead is about 1x the front's own cost, where a
    CPU clock (time.thread_time, called from Python per event) costs 4x and distorts small
    functions most. The idle wait (epoll) is then part of the profile; front_profile keeps
    it out of the groups."""
    profiler = cProfile.Profile()

    def start(signum: int, frame: object) -> None:
        nonlocal profiler
        profiler = cProfile.Profile()  # a fresh window
        profiler.enable()

    def stop(signum: int, frame: object) -> None:
        profiler.disable()
        profiler.dump_stats(path + ".tmp")
        os.replace(path + ".tmp", path)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
