"""Prometheus metrics of the server (one registry per server, served at /metrics).

Counters and latency histograms are observed by the front as requests progress; the
scheduler gauges mirror its latest `SchedulerSnapshot` (from Ready on, before the first
request) and read NaN once the scheduler is gone (no value is better than a stale one).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from radixrt.server.messages import SchedulerSnapshot

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
        self.running = g("radixrt_num_requests_running", "Requests running in the scheduler")
        self.waiting = g("radixrt_num_requests_waiting", "Requests waiting in the scheduler")
        self.cache_hit_rate = g(
            "radixrt_cache_hit_rate", "Cached / prompt tokens of admitted requests since start"
        )
        self.kv_blocks_total = g("radixrt_kv_blocks_total", "KV blocks in the pool")
        self.kv_blocks_free = g("radixrt_kv_blocks_free", "KV blocks nobody holds")
        self.kv_blocks_cached = g("radixrt_kv_blocks_cached", "KV blocks the prefix cache holds")
        self.kv_blocks_in_use = g(
            "radixrt_kv_blocks_in_use",
            "KV blocks held by requests or locked cache paths (not free, not evictable)",
        )
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
        self.failed_requests = g(
            "radixrt_scheduler_failed_requests",
            "Requests the scheduler failed on a host-side exception of their own, since start",
        )
        self.failed_steps = g(
            "radixrt_scheduler_failed_steps",
            "Steps whose batched forward raised (their requests failed), since start",
        )
        self.spec_draft_tokens = g(
            "radixrt_spec_draft_tokens", "Speculative draft tokens verified, since start"
        )
        self.spec_accepted_tokens = g(
            "radixrt_spec_accepted_tokens", "Speculative draft tokens accepted, since start"
        )
        self.spec_verify_rows = g(
            "radixrt_spec_verify_rows", "Rows that verified speculative drafts, since start"
        )
        # n > 1 forks and beam search: the snapshot field of the same name, since start
        self.group_gauges = {
            name: g(f"radixrt_{name}", doc)
            for name, doc in (
                ("forks", "Request groups (n > 1, beam search) forked, since start"),
                ("fork_shared_blocks", "Full prompt blocks shared by reference at forks"),
                ("fork_copied_blocks", "Partial prompt blocks copied at forks"),
                ("beam_steps", "Beam-search selection steps, since start"),
                ("beam_shared_blocks", "Full blocks shared by re-parented beams"),
                ("beam_copied_blocks", "Partial blocks copied for re-parented beams"),
            )
        }
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
        # host KV tier (zero without one): snapshot field -> gauge
        self.host_tier = {
            field: g(f"radixrt_{field}", doc)
            for field, doc in (
                ("host_hit_tokens", "Prompt tokens loaded from the host KV tier, since start"),
                ("host_written_back_blocks", "KV blocks written back to the host, since start"),
                ("host_loaded_blocks", "KV blocks loaded from the host, since start"),
                ("host_evicted_blocks", "Host KV blocks freed by host LRU eviction, since start"),
                ("host_kv_blocks_total", "KV blocks in the host pool"),
                ("host_kv_blocks_free", "Host KV blocks nobody holds"),
                ("host_kv_blocks_cached", "Host KV blocks the prefix cache holds"),
                ("swap_out_bytes", "Bytes copied device -> host by write-backs, since start"),
                ("swap_in_bytes", "Bytes copied host -> device by loads, since start"),
                ("swap_seconds", "Seconds of host <-> device KV transfers, since start"),
            )
        }
        # structured output (radixrt.grammar.base.GrammarStats): snapshot field -> gauge
        self.grammar = {
            field: g(f"radixrt_{field}", doc)
            for field, doc in (
                ("grammar_cache_hits", "Constrained requests whose grammar was cached"),
                ("grammar_cache_misses", "Constrained requests that started a grammar compile"),
                ("grammar_cache_evictions", "Compiled grammars dropped to bound the cache"),
                ("grammar_cache_bytes", "Bytes the grammar cache holds"),
                ("grammar_compile_timeouts", "Grammar compiles stopped at the time limit"),
                ("grammar_compile_preemptions", "Grammar compiles stopped for a waiting one"),
            )
        }
        # retention hints (cache_ttl_s): snapshot field -> gauge
        self.retention = {
            field: g(f"radixrt_{field}", doc)
            for field, doc in (
                ("retention_holds", "Finished contexts held cached (cache_ttl_s), since start"),
                ("retention_expired", "Retention holds ended by their time to live"),
                ("retention_released", "Retention holds given up for room"),
                ("retention_held_blocks", "KV blocks retention holds keep now"),
            )
        }
        self._scheduler_gauges = (*self.host_tier.values(), *self.grammar.values(),
            *self.retention.values(),
            self.running, self.waiting, self.cache_hit_rate, self.kv_blocks_total,
            self.kv_blocks_free, self.kv_blocks_cached, self.kv_blocks_in_use,
            self.failed_requests, self.failed_steps, self.spec_draft_tokens,
            self.spec_accepted_tokens, self.spec_verify_rows, *self.group_gauges.values(),
        )  # fmt: skip

    def update(self, snap: SchedulerSnapshot) -> None:
        self.running.set(snap.running)
        self.waiting.set(snap.waiting)
        self.cache_hit_rate.set(snap.cache_hit_rate)
        self.kv_blocks_total.set(snap.kv_blocks_total)
        self.kv_blocks_free.set(snap.kv_blocks_free)
        self.kv_blocks_cached.set(snap.kv_blocks_cached)
        self.kv_blocks_in_use.set(snap.kv_blocks_in_use)
        self.failed_requests.set(snap.failed_requests)
        self.failed_steps.set(snap.failed_steps)
        self.spec_draft_tokens.set(snap.spec_draft_tokens)
        self.spec_accepted_tokens.set(snap.spec_accepted_tokens)
        self.spec_verify_rows.set(snap.spec_verify_rows)
        for name, gauge in self.group_gauges.items():
            gauge.set(getattr(snap, name))
        for field, gauge in (*self.host_tier.items(), *self.retention.items()):
            gauge.set(getattr(snap, field))
        for field, gauge in self.grammar.items():
            gauge.set(getattr(snap, field))

    def scheduler_gone(self) -> None:
        self.ready.set(0)
        for gauge in self._scheduler_gauges:
            gauge.set(float("nan"))

    def finished(self, reason: str, prompt_tokens: int, cached_tokens: int, e2e_s: float) -> None:
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
