"""Per-step timeline of a serving run: where the GPU is busy, where it waits for the host.

Wraps the engine's runner so that every `execute(plan)` is bracketed by CUDA events (on
the stream the runner launches on) and host timestamps, runs one workload through the
same driver as bench_serving, and prints, per kind of step (decode-only, mixed
prefill+decode, prefill-only): steps, GPU time (event to event), host time spent inside
`execute` (layout + launch), and the GPU idle time before the step (the gap between the
previous step's end event and this step's start event). Device only: on CPU the events are
host timestamps and the idle column means nothing.

  python -m benchmarks.bench_timeline --model $M --device cuda --dtype bfloat16 \
      --load-format dummy [--disable-overlap-schedule] [--workload random --size full]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

from benchmarks.engine_driver import run_engine
from benchmarks.workloads import make_workload
from radixrt.plan import StepHandle, StepPlan


@dataclass
class StepRecord:
    step_id: int
    decode_rows: int  # rows feeding one token
    extend_rows: int  # prefill chunks (and verify rows)
    extend_tokens: int
    host_ms: float  # wall time inside execute (layout + launch)
    events: tuple = ()  # (start, end) CUDA events
    gpu_ms: float = 0.0
    idle_before_ms: float = 0.0

    @property
    def kind(self) -> str:
        if self.extend_rows == 0:
            return "decode"
        return "mixed" if self.decode_rows else "prefill"


@dataclass
class TimelineRunner:
    """A runner proxy that records a StepRecord per `execute`."""

    inner: object
    records: list[StepRecord] = field(default_factory=list)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, plan: StepPlan, **kw) -> StepHandle:
        import torch

        cuda = torch.cuda.is_available()
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record()
        t0 = time.perf_counter()
        handle = self.inner.execute(plan, **kw)
        host_ms = (time.perf_counter() - t0) * 1e3
        end = None
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        decode = [r for r in plan.rows if r.num_tokens == 1]
        extend = [r for r in plan.rows if r.num_tokens > 1]
        rec = StepRecord(
            plan.step_id, len(decode), len(extend), sum(r.num_tokens for r in extend), host_ms
        )
        rec.events = (start, end) if cuda else ()
        self.records.append(rec)
        return handle


def resolve(records: list[StepRecord]) -> None:
    """Fill gpu_ms / idle_before_ms from the events (synchronises the device)."""
    import torch

    if not records or not records[0].events:
        for r in records:
            r.gpu_ms = r.host_ms
        return
    torch.cuda.synchronize()
    prev_end = None
    for r in records:
        start, end = r.events
        r.gpu_ms = start.elapsed_time(end)
        r.idle_before_ms = prev_end.elapsed_time(start) if prev_end is not None else 0.0
        prev_end = end
        r.events = ()


def summarize(records: list[StepRecord]) -> list[dict]:
    rows = []
    for kind in ("decode", "mixed", "prefill"):
        rs = [r for r in records if r.kind == kind]
        if not rs:
            continue
        gpu = sorted(r.gpu_ms for r in rs)
        rows.append(
            dict(
                kind=kind,
                steps=len(rs),
                gpu_s=sum(gpu) / 1e3,
                gpu_ms_p50=gpu[len(gpu) // 2],
                host_ms_mean=sum(r.host_ms for r in rs) / len(rs),
                idle_s=sum(r.idle_before_ms for r in rs) / 1e3,
                extend_tokens=sum(r.extend_tokens for r in rs),
                decode_rows_mean=sum(r.decode_rows for r in rs) / len(rs),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: the tiny model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--workload", default="random")
    p.add_argument("--size", default="full", choices=["full", "smoke"])
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--json", default=None, help="write every step record here")
    args = p.parse_args(argv)

    from radixrt.engine import Engine
    from radixrt.model.tiny import ensure_tiny_model

    model = args.model or str(ensure_tiny_model())
    opts = dict(
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_running_requests=args.max_running_requests,
        freeze_gc=True,  # as the server's scheduler process does
    )
    if args.disable_overlap_schedule:
        opts["overlap_schedule"] = False
    engine = Engine(model, **opts)
    vocab = engine.model_config.vocab_size
    warm = make_workload("random", "smoke", scale=0.25, vocab_size=vocab)
    run_engine(engine, warm)
    engine.cache.reset()
    tl = TimelineRunner(engine.core.runner)
    engine.core.runner = tl
    w = make_workload(args.workload, args.size, args.scale, vocab_size=vocab)
    result = run_engine(engine, w)
    resolve(tl.records)
    out_tokens = sum(r.output_tokens for r in result.records)
    rows = summarize(tl.records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([vars(r) for r in tl.records], f)
    overlap = engine.core.overlap
    print(
        f"\n{args.workload} {args.size}: overlap {'on' if overlap else 'off'}, "
        f"{result.duration_s:.2f} s, {out_tokens / result.duration_s:,.0f} out tok/s, "
        f"{len(tl.records)} steps"
    )
    print(
        "| kind | steps | GPU s | GPU ms p50 | host ms/step (execute) | GPU idle before, s |"
        " extend tokens | decode rows/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kind']} | {r['steps']} | {r['gpu_s']:.2f} | {r['gpu_ms_p50']:.2f} | "
            f"{r['host_ms_mean']:.2f} | {r['idle_s']:.2f} | {r['extend_tokens']} | "
            f"{r['decode_rows_mean']:.0f} |"
        )
    busy = sum(r["gpu_s"] for r in rows)
    idle = sum(r["idle_s"] for r in rows)
    print(f"GPU busy {busy:.2f} s, idle between steps {idle:.2f} s, wall {result.duration_s:.2f} s")
    engine.shutdown()


if __name__ == "__main__":
    main()
