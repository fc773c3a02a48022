"""Per-call timings, per-run summaries and the results table."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class CallRecord:
    """One finished call; times in seconds since the run started."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens served by the prefix cache
    output_tokens: int
    submit: float  # sent to the engine / server
    first_token: float  # first output token arrived (prefill-only call: it finished)
    end: float  # last token arrived
    token_times: list[float] = field(default_factory=list)  # arrival of each output token
    program: int | None = None  # its program's index in the workload (None: not recorded)


@dataclass
class KVStats:
    """KV memory over one run (None: the backend does not report it)."""

    blocks_total: int | None = None
    peak_blocks_used: int | None = None  # not free: held by requests or by the cache
    peak_blocks_active: int | None = None  # held by running requests or locked cache paths
    evicted_blocks: int | None = None
    preemptions: int | None = None
    steps: int | None = None
    # prompt positions fed to the model (recomputed ones too) and the host KV tier's work
    prompt_tokens_computed: int | None = None
    host_hit_tokens: int | None = None
    host_written_back_blocks: int | None = None
    host_loaded_blocks: int | None = None
    swap_bytes: int | None = None  # both directions
    swap_seconds: float | None = None


@dataclass
class DriverResult:
    records: list[CallRecord]
    duration_s: float  # first submission to last token (or to the timeout)
    kv: KVStats
    complete: bool  # False when the run hit its timeout (the rest was aborted)
    client_cpu_s: float | None = None  # the HTTP client's process CPU time over the run


def percentiles(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """p50 / p95 / p99 / mean of `values` times `scale` (default: seconds -> ms)."""
    if not len(values):
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0, "mean": 0.0}
    arr = np.asarray(values, dtype=np.float64) * scale
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "mean": float(arr.mean())}


def summarize(result: DriverResult) -> dict[str, object]:
    """Throughput, latency percentiles, hit rate and KV figures of one run."""
    recs, dt = result.records, max(result.duration_s, 1e-9)
    prompt = sum(r.prompt_tokens for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    output = sum(r.output_tokens for r in recs)
    itl = [b - a for r in recs for a, b in zip(r.token_times, r.token_times[1:])]
    # once every call has its first token no prompt is prefilled any more (unless calls
    # arrive later): the decode-only inter-token latency, apart from admission's steps
    admitted = max((r.first_token for r in recs), default=0.0)
    itl_steady = [
        b - a for r in recs for a, b in zip(r.token_times, r.token_times[1:]) if a >= admitted
    ]
    kv = result.kv
    return {
        "complete": result.complete,
        "num_calls": len(recs),
        "duration_s": result.duration_s,
        "request_throughput": len(recs) / dt,
        "input_throughput": prompt / dt,
        "output_throughput": output / dt,
        "total_throughput": (prompt + output) / dt,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_ms": percentiles([r.first_token - r.submit for r in recs]),
        "itl_ms": percentiles(itl),
        "itl_after_admission_ms": percentiles(itl_steady),
        "e2e_ms": percentiles([r.end - r.submit for r in recs]),
        "kv_blocks_total": kv.blocks_total,
        "peak_kv_blocks_used": kv.peak_blocks_used,
        "peak_kv_blocks_active": kv.peak_blocks_active,
        "evicted_blocks": kv.evicted_blocks,
        "preemptions": kv.preemptions,
        "steps": kv.steps,
        "prompt_tokens_computed": kv.prompt_tokens_computed,
        "host_hit_tokens": kv.host_hit_tokens,
        "host_written_back_blocks": kv.host_written_back_blocks,
        "host_loaded_blocks": kv.host_loaded_blocks,
        "swap_bytes": kv.swap_bytes,
        "swap_seconds": kv.swap_seconds,
        "mean_step_ms": 1000 * result.duration_s / kv.steps if kv.steps else None,
        # what receiving and parsing the streams cost the client (None: in-process engine)
        "client_cpu_us_per_token": (
            1e6 * result.client_cpu_s / output
            if result.client_cpu_s is not None and output
            else None
        ),
    }


BASELINE = "blockhash+fcfs"  # the "x blockhash" column divides by this config's throughput
TABLE_HEADER = (
    "| workload | config | req/s | in tok/s | out tok/s | TTFT p50/p99 ms | ITL p50/p99 ms "
    "| E2E p50/p99 ms | hit % (best) | peak KV used/active/total | evicted | preempt "
    "| x blockhash | spread |"
)


def format_table(runs: Sequence[dict]) -> str:
    """Markdown table, one row per run; 'x blockhash' is the run's request throughput over
    the blockhash run of the same workload (same requests, so any throughput ratio)."""
    baseline = {r["workload"]: r["request_throughput"] for r in runs if r["config"] == BASELINE}
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for r in runs:
        base = baseline.get(r["workload"])
        ratio = f"{r['request_throughput'] / base:.3f}" if base else "-"
        kv = "/".join(_opt(r[k]) for k in ("peak_kv_blocks_used", "peak_kv_blocks_active"))
        status = "" if r["complete"] else " TIMEOUT"
        lines.append(
            f"| {r['workload']}{status} | {r['config']} | {r['request_throughput']:.2f} "
            f"| {r['input_throughput']:.0f} | {r['output_throughput']:.0f} "
            f"| {_pair(r['ttft_ms'])} | {_pair(r['itl_ms'])} | {_pair(r['e2e_ms'])} "
            f"| {100 * r['hit_rate']:.1f} ({100 * r['best_hit_rate']:.1f}) "
            f"| {kv}/{_opt(r['kv_blocks_total'])} | {_opt(r['evicted_blocks'])} "
            f"| {_opt(r['preemptions'])} | {ratio} "
            f"| {100 * r.get('duration_spread', 0.0):.0f}% |"
        )
    return "\n".join(lines)


def _pair(p: dict[str, float]) -> str:
    return f"{p['p50']:.0f}/{p['p99']:.0f}" if p["p99"] >= 10 else f"{p['p50']:.1f}/{p['p99']:.1f}"


def _opt(x: object) -> str:
    return "n/a" if x is None else str(x)


def save_results(out_dir: str, tag: str, results: dict, markdown: str) -> str:
    """Write `<tag>.json` (atomically: a run killed midway keeps the last complete file) and
    `<tag>.md` under `out_dir`; returns the path without its extension."""
    base = os.path.join(out_dir, tag)
    with open(base + ".json.tmp", "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(base + ".json.tmp", base + ".json")
    with open(base + ".md", "w") as f:
        f.write(markdown)
    return base


def targets_markdown(targets: Sequence[dict], sep: str = "\n") -> str:
    """The targets' lines of a results file: `- STATUS: text`."""
    return sep.join(f"- {t['status']}: {t['text']}" for t in targets)
