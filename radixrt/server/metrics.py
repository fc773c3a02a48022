"""Prometheus metrics of the server (one registry per server, served at /metrics).

Counters and latency histograms are observed by the front as requests progress; the
scheduler gauges, one per `EngineStats` field (radixrt.stats), mirror its latest
`SchedulerSnapshot` (from Ready on, before the first request) and read NaN once the
scheduler is gone (no value is better than a stale one).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from radixrt.server.messages import SchedulerSnapshot
from radixrt.stats import STAT_FIELDS

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
CONTENT_TYPE = CONTENT_TYPE_LATEST


class LatencyHistogram:
    """A Prometheus histogram observed once per stream per step (inter-token latency):
    a bisect and two additions, without prometheus_client's lock and per-bucket objects
    (~1 µs of the front's per-token budget each). The front's event loop is its only
    writer; /metrics renders on the same loop."""

    def __init__(
        self, name: str, doc: str, buckets: tuple[float, ...], registry: CollectorRegistry
    ) -> None:
        self.name, self.doc = name, doc
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += n
            cumulative.append((bound, total))
        yield HistogramMetricFamily(self.name, self.doc, buckets=cumulative, sum_value=self.sum)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "radixrt_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("radixrt_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "radixrt_cached_tokens", "Prompt tokens served by the prefix cache", registry=r
        )
        self.generated_tokens = Counter("radixrt_generated_tokens", "Generated tokens", registry=r)
        self.ttft = LatencyHistogram(
            "radixrt_time_to_first_token_seconds",
            "Time from request arrival to its first token",
            LATENCY_BUCKETS,
            r,
        )
        self.itl = LatencyHistogram(
            "radixrt_inter_token_latency_seconds",
            "Time between consecutive token deliveries of a request",
            LATENCY_BUCKETS,
            r,
        )
        self.e2e = LatencyHistogram(
            "radixrt_e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            LATENCY_BUCKETS,
            r,
        )
        g = lambda name, doc: Gauge(name, doc, registry=r)
        # the scheduler's EngineStats, field for field (per-position lists: label `position`,
        # per-adapter dicts: label `lora`)
        self.scheduler_gauges = {
            f.name: Gauge(
                f"radixrt_{f.metric}",
                f.description,
                [f.label] if f.label else (),
                registry=r,
            )
            for f in STAT_FIELDS
        }
        self.ready = g("radixrt_ready", "1 when the scheduler is up and serving")
        self.scheduler_stalled = g(
            "radixrt_scheduler_stalled",
            "1 while the scheduler has work but made no progress past the stall timeout",
        )
        self.scheduler_stalls = Counter(
            "radixrt_scheduler_stalls",
            "Times the scheduler was found stalled (work in flight, no progress past the limit)",
            registry=r,
        )
        self.in_flight = g("radixrt_front_in_flight", "Requests the front holds state for")
        self.rejected = Counter(
            "radixrt_rejected_requests",
            "HTTP requests answered with an error before generating, by status",
            ["status"],
            registry=r,
        )
        self.http_connections = g("radixrt_http_connections", "HTTP connections open")
        self.http_connections_refused = Counter(
            "radixrt_http_connections_refused",
            "HTTP connections refused (503) because the connection cap was reached",
            registry=r,
        )
        self.http_timeouts = Counter(
            "radixrt_http_timeouts",
            "HTTP requests whose head or body did not arrive in time, by phase",
            ["phase"],
            registry=r,
        )
        self.internal_errors = Counter(
            "radixrt_internal_errors", "HTTP requests that failed on a server bug (500)", registry=r
        )

    def update(self, snap: SchedulerSnapshot) -> None:
        stats = snap.stats
        for f in STAT_FIELDS:
            gauge, value = self.scheduler_gauges[f.name], getattr(stats, f.name)
            if f.label:
                for key, v in f.labelled(value):
                    gauge.labels(key).set(v)
            else:
                gauge.set(value)

    def scheduler_gone(self) -> None:
        self.ready.set(0)
        for f in STAT_FIELDS:
            gauge = self.scheduler_gauges[f.name]
            if f.label:
                gauge.clear()  # no position (adapter) has a value
            else:
                gauge.set(float("nan"))

    def finished(self, reason: str, prompt_tokens: int, cached_tokens: int, e2e_s: float) -> None:
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
