"""The front process of the front-capacity benchmark: the REAL front and HTTP app, served
by `radixrt.server.launch.serve` (as `radixrt serve` does), with the fake scheduler process
of benchmarks.front_fake_scheduler in place of the real one.

Optional: pinned to given CPUs (before any thread starts, so the ZMQ I/O thread and the
tokenizer's threads are pinned too), and a cProfile window that the parent opens with
SIGUSR1 and closes with SIGUSR2 (the stats go to `profile_path`, written atomically).
"""

from __future__ import annotations

import cProfile
import functools
import logging
import os
import signal
from dataclasses import dataclass

from benchmarks.front_fake_scheduler import FakeSchedulerArgs, start_fake_scheduler


@dataclass(frozen=True)
class FrontArgs:
    model: str  # the tokenizer's model dir
    port: int
    scheduler: FakeSchedulerArgs
    cpus: tuple[int, ...] | None = None  # sched_setaffinity of the front (None: any)
    profile_path: str | None = None  # arm the SIGUSR1/SIGUSR2 cProfile window


def front_main(args: FrontArgs) -> None:
    if args.cpus is not None:
        os.sched_setaffinity(0, args.cpus)
    logging.basicConfig(level="WARNING", format="%(asctime)s front %(levelname)s %(message)s")
    if args.profile_path is not None:
        _arm_profiler(args.profile_path)
    from radixrt.server.launch import ServeConfig, serve

    cfg = ServeConfig(model=args.model, port=args.port, device="cpu", dtype="float32")
    code = serve(cfg, start_scheduler=functools.partial(start_fake_scheduler, args.scheduler))
    raise SystemExit(code)


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
