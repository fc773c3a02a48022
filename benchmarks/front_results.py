"""Configuration and results of one front-capacity run (benchmarks.bench_front): what was
sent and received, ITL, CPU per token, and the check that every token arrived in order,
exactly once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.front_clients import PARSERS, ROUTES, ClientResult, StreamResult
from benchmarks.front_fake_scheduler import TokenSource
from benchmarks.front_process import FrontStats
from benchmarks.front_profile import IDLE


@dataclass(frozen=True)
class RunConfig:
    streams: int  # N concurrent streams, all started together
    interval_s: float  # the fake scheduler's step interval
    max_tokens: int  # tokens per stream
    route: str = "/generate"
    parse: str = "chunks"  # how the clients read SSE (benchmarks.front_clients)
    stop: tuple[str, ...] = ()  # stop strings sent with every request (never matched)

    def __post_init__(self) -> None:
        if self.streams < 1:
            raise ValueError(f"streams={self.streams}: need at least 1")
        if not 0 < self.interval_s <= 10:
            raise ValueError(f"interval_s={self.interval_s}: must be in (0, 10] seconds")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens={self.max_tokens}: need at least 2 (for an ITL)")
        if self.route not in ROUTES:
            raise ValueError(f"route={self.route!r}: must be one of {ROUTES}")
        if self.parse not in PARSERS:
            raise ValueError(f"parse={self.parse!r}: must be one of {PARSERS}")

    @property
    def offered_tok_s(self) -> float:
        return self.streams / self.interval_s


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p95: float
    p99: float

    @staticmethod
    def of(values: np.ndarray, scale: float = 1000.0) -> Percentiles:
        if not len(values):
            return Percentiles(0.0, 0.0, 0.0)
        p50, p95, p99 = np.percentile(values * scale, [50, 95, 99])
        return Percentiles(float(p50), float(p95), float(p99))


@dataclass(frozen=True)
class FrontDelta:
    """The front process during one run."""

    cpu_s: float  # its own CPU clock (getrusage in the front: every thread)
    wait_s: float  # its threads runnable but not running (other processes, or each other)
    gc_collections: tuple[int, int, int]  # per generation
    gc_pause_s: float  # total time in its garbage collector
    gc_max_pause_s: float  # the longest collection

    @staticmethod
    def between(before: FrontStats, after: FrontStats, wait_s: float) -> FrontDelta:
        gens = tuple(b - a for a, b in zip(before.gc_collections, after.gc_collections))
        pause = after.gc_pause_s - before.gc_pause_s
        return FrontDelta(after.cpu_s - before.cpu_s, wait_s, gens, pause, after.gc_max_pause_s)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RunResult:
    config: RunConfig
    clients: int  # client processes
    tokens_sent: int  # by the fake scheduler
    tokens_received: int  # by the clients (sum of completion_tokens)
    events: int  # SSE events that carried tokens or text
    steps: int  # the fake scheduler's steps
    late_steps: int  # of those, over one interval late (the fake scheduler, not the front)
    scheduler_tok_s: float  # tokens_sent / (first step - interval .. last step)
    achieved_tok_s: float  # tokens_received / (first step - interval .. last arrival)
    # inter-token latency, ms: per token (an event with k tokens: one gap, k - 1 zero
    # gaps; as bench_serving counts) and per event; /v1/completions: per event only
    itl_token_ms: Percentiles
    itl_event_ms: Percentiles
    step_gap_ms: Percentiles  # the fake scheduler's own step-to-step gaps
    wall_s: float  # first step - interval .. last arrival
    front: FrontDelta  # the front process while the clients ran
    client_cpu_s: float  # all client processes together
    client_max_util: float  # the busiest client process: CPU / wall
    scheduler_cpu_s: float
    errors: list[str] = field(default_factory=list)  # tokens missing, reordered, doubled

    @property
    def front_us_per_token(self) -> float:
        return 1e6 * self.front.cpu_s / max(1, self.tokens_received)

    @property
    def client_us_per_token(self) -> float:
        return 1e6 * self.client_cpu_s / max(1, self.tokens_received)

    @property
    def front_util(self) -> float:
        return self.front.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def sustained(self) -> bool:
        """Kept up: ITL p99 within 2x the step interval and >= 90% of the offered rate."""
        ok_itl = self.itl_token_ms.p99 <= 2000 * self.config.interval_s
        return ok_itl and self.achieved_tok_s >= 0.9 * self.config.offered_tok_s


@dataclass(frozen=True)
class ProfileResult:
    """A run under the front's cProfile, and the same configuration without it. The
    profiler slows the front (about 2x), so its self times give shares, and a group's
    cost per token is its share of the unprofiled run's front CPU per token."""

    run: RunResult  # profiled
    baseline: RunResult  # the same configuration, not profiled
    seconds_by_group: dict[str, float]  # cProfile self time, front_profile.GROUPS + IDLE
    # per group, its largest contributors: ("file:line(function)", self seconds)
    top: dict[str, list[tuple[str, float]]] = field(default_factory=dict)

    def shares(self) -> dict[str, float]:
        """Each group's fraction of the profiled busy time (idle excluded)."""
        busy = {g: s for g, s in self.seconds_by_group.items() if g != IDLE}
        total = sum(busy.values()) or 1.0
        return {g: s / total for g, s in busy.items()}

    def us_per_token(self) -> dict[str, float]:
        """Each group's share x the unprofiled front CPU per token."""
        return {g: f * self.baseline.front_us_per_token for g, f in self.shares().items()}

    def profiled_us_per_token(self) -> dict[str, float]:
        n = max(1, self.run.tokens_received)
        return {g: 1e6 * s / n for g, s in self.seconds_by_group.items()}


def summarize(
    config: RunConfig,
    results: list[ClientResult],
    stats: dict[str, Any],
    front: FrontDelta,
    source: TokenSource,
    decode: Callable[[list[int]], str] | None = None,
) -> RunResult:
    streams = [s for r in results for s in r.streams]
    errors = check_streams(config, streams, source, decode)
    step_times = np.asarray(stats["step_times"])
    start = step_times[0] - config.interval_s if len(step_times) else 0.0
    last_arrival = max((s.event_times[-1] for s in streams if s.event_times), default=start)
    received = sum(s.completion_tokens for s in streams)
    token_gaps, event_gaps = [], []
    for s in streams:
        times = np.asarray(s.event_times)
        event_gaps.append(np.diff(times))
        counts = s.event_tokens
        token_gaps.append(
            np.diff(np.repeat(times, counts)) if counts is not None else np.diff(times)
        )
    sched_span = step_times[-1] - start if len(step_times) else 0.0
    wall = last_arrival - start
    return RunResult(
        config=config,
        clients=len(results),
        tokens_sent=int(stats["tokens_emitted"]),
        tokens_received=received,
        events=sum(len(s.event_times) for s in streams),
        steps=len(step_times),
        late_steps=int(stats["late_steps"]),
        scheduler_tok_s=float(stats["tokens_emitted"] / sched_span) if sched_span > 0 else 0.0,
        achieved_tok_s=float(received / wall) if wall > 0 else 0.0,
        itl_token_ms=Percentiles.of(np.concatenate(token_gaps)),
        itl_event_ms=Percentiles.of(np.concatenate(event_gaps)),
        step_gap_ms=Percentiles.of(np.diff(step_times)),
        wall_s=float(wall),
        front=front,
        client_cpu_s=sum(r.cpu_s for r in results),
        client_max_util=max(r.cpu_s / r.wall_s for r in results if r.wall_s > 0),
        scheduler_cpu_s=float(stats["cpu_s"]),
        errors=errors + ([f"{stats['rows_left']} rows left"] if stats["rows_left"] else []),
    )


def check_streams(
    config: RunConfig,
    streams: list[StreamResult],
    source: TokenSource,
    decode: Callable[[list[int]], str] | None = None,
) -> list[str]:
    """What went wrong: a stream missing, unfinished, or whose tokens are not exactly the
    ones sent, in order (by ids for /generate, by count for /v1/completions), or (with
    `decode`) whose text is not their text."""
    errors = []
    seen = sorted(s.stream for s in streams)
    if seen != list(range(config.streams)):
        errors.append(f"streams received {seen[:8]}..., expected 0..{config.streams - 1}")
    for s in streams:
        expected = source.stream_tokens(source.prompt_ids(s.stream), config.max_tokens)
        if not s.done or s.finish_reason != "length":
            errors.append(f"stream {s.stream}: done={s.done} finish_reason={s.finish_reason}")
        if s.event_tokens is not None and s.output_ids != expected:
            errors.append(f"stream {s.stream}: received ids differ from those sent")
        if s.completion_tokens != config.max_tokens:
            errors.append(f"stream {s.stream}: {s.completion_tokens} tokens, not {len(expected)}")
        if decode is not None and s.text != decode(expected):
            errors.append(f"stream {s.stream}: received text differs from the tokens' text")
    return errors
