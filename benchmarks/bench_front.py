"""Front capacity: how many streamed tokens/s the HTTP front sustains, and what one costs.

    python -m benchmarks.bench_front                 # sweep step rates at 256 streams
    python -m benchmarks.bench_front --quick         # a 20-second check
    python -m benchmarks.bench_front --profile       # + the front's per-token cost breakdown
    python -m benchmarks.bench_front --streams 64,128,256 --interval-ms 10   # sweep streams
    python -m benchmarks.bench_front --compare /path/to/other/checkout       # A/B, interleaved

The REAL front and HTTP app (radixrt.server.launch.serve) run in their own process, pinned
to one core (--front-cpu), with a FAKE scheduler process that speaks the real protocol and
emits one real text token per running stream every step interval (no model). REAL aiohttp
clients in --clients processes stream POST /generate (or /v1/completions) and time every
SSE event. Per configuration (N streams, step interval): offered tok/s (N / interval),
what the fake scheduler emitted, what the clients received (achieved), ITL per token (an
event carrying k tokens: one gap, then k - 1 zero gaps, as bench_serving counts) and per
event, against the interval; the CPU per token of the front (its own process counters,
all threads), of the clients and of the fake scheduler; and how long the front was
runnable but waiting for its core (other processes: a noisy machine, or its own other
threads, the ZMQ I/O thread, on the one core), and its
garbage collector's longest pause. A run is
"sustained" when ITL p99 <= 2x the interval and achieved >= 90% of offered. Every token
is checked: it arrived, in order, exactly once (ids and text).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # radixrt is imported in main() only: a process spawned from here
    # imports this module first, and may run another checkout's radixrt (--compare)
    from benchmarks.front_results import ProfileResult, RunConfig, RunResult

DEFAULT_RATES = (4000, 8000, 12000, 16000, 20000, 25000, 32000, 40000)  # offered tok/s
QUICK_RATES = (2000, 4000, 8000)
MIN_TOKENS = 32  # per stream, whatever the duration
NOISY_WAIT = 0.10  # a run whose front waited this fraction of its wall time for a CPU
MAX_FAILS = 2  # the sweep stops after this many configurations in a row not sustained


def sweep_configs(args: argparse.Namespace) -> list[RunConfig]:
    """The sweep: step rates at a fixed stream count, or stream counts at a fixed interval.
    Each configuration runs about --duration seconds (at least MIN_TOKENS per stream)."""

    from benchmarks.front_results import RunConfig

    def config(streams: int, interval_s: float) -> RunConfig:
        tokens = max(MIN_TOKENS, round(args.duration / interval_s))
        stop = tuple(f"\x00never{i}" for i in range(args.stop_strings))
        return RunConfig(streams, interval_s, tokens, args.route, args.parse, stop)

    if args.interval_ms is not None:
        return [config(n, args.interval_ms / 1000) for n in args.streams]
    (n,) = args.streams
    return [config(n, n / rate) for rate in args.rates]


def run_sweep(rigs: dict, configs: list[RunConfig], keep_going: bool) -> dict[str, list]:
    """Every configuration on every rig in turn (A, B, A, B, ... with --compare); stops
    once every rig missed MAX_FAILS configurations in a row (unless keep_going)."""
    results: dict[str, list[RunResult]] = {label: [] for label in rigs}
    fails = dict.fromkeys(rigs, 0)
    for config in configs:
        for label, rig in rigs.items():
            r = rig.run(config)
            results[label].append(r)
            print(row(r, label), flush=True)
            if r.errors:
                raise RuntimeError(f"{label}: tokens lost or wrong: {r.errors[:5]}")
            fails[label] = 0 if r.sustained else fails[label] + 1
        if min(fails.values()) >= MAX_FAILS and not keep_going:
            break
    return results


HEADER = (
    "| streams | interval ms | offered tok/s | sched tok/s | achieved tok/s "
    "| ITL/token p50 / p95 / p99 ms | ITL/event p99 ms | front µs/tok | front CPU % "
    "| front wait % | front GC max ms (gen2 n) | clients µs/tok (max CPU %) | sustained |"
)
SEPARATOR = "|" + "---|" * (HEADER.count("|") - 1)


def header(labels: bool) -> str:
    return ("| front " if labels else "") + HEADER


def separator(labels: bool) -> str:
    return ("|---" if labels else "") + SEPARATOR


def row(r: RunResult, label: str = "") -> str:
    c, t = r.config, r.itl_token_ms
    wait = 100 * r.front.wait_s / r.wall_s if r.wall_s else 0.0
    gc = f"{1000 * r.front.gc_max_pause_s:.0f} ({r.front.gc_collections[2]})"
    return (("| " + label + " ") if label else "") + (
        f"| {c.streams} | {1000 * c.interval_s:.2f} | {c.offered_tok_s:,.0f} "
        f"| {r.scheduler_tok_s:,.0f} | {r.achieved_tok_s:,.0f} "
        f"| {t.p50:.1f} / {t.p95:.1f} / {t.p99:.1f} | {r.itl_event_ms.p99:.1f} "
        f"| {r.front_us_per_token:.1f} | {100 * r.front_util:.0f} | {wait:.0f} | {gc} "
        f"| {r.client_us_per_token:.1f} ({100 * r.client_max_util:.0f}) "
        f"| {'yes' if r.sustained else 'no'} |"
    )


def print_profile(p: ProfileResult, top: int, label: str = "") -> None:
    b = p.baseline
    print(
        f"\n{label + ': ' if label else ''}front cost per token, {b.config.streams} streams at "
        f"{1000 * b.config.interval_s:.2f} ms ({b.config.offered_tok_s:,.0f} tok/s offered): "
        f"{b.front_us_per_token:.1f} µs/token of front CPU unprofiled (all threads), "
        f"split by the profile's self-time shares (main thread; profiled "
        f"{sum(v for g, v in p.profiled_us_per_token().items() if 'idle' not in g):.1f} "
        f"µs/token busy). Not in the profile: the ZMQ I/O thread, and uvloop's own C "
        f"loop (its Python callbacks are); the first column spreads them over the groups."
    )
    print("| group | µs/token (share x unprofiled) | µs/token profiled | share |")
    print("|---|---|---|---|")
    shares, costs, raw = p.shares(), p.us_per_token(), p.profiled_us_per_token()
    for g in shares:
        print(f"| {g} | {costs[g]:.1f} | {raw[g]:.1f} | {100 * shares[g]:.0f}% |")
    if top:
        n = max(1, p.run.tokens_received)
        for g, items in p.top.items():
            print(f"  {g}:")
            for name, seconds in items[:top]:
                print(f"    {1e6 * seconds / n:8.2f} µs/token (profiled)  {name}")


def best_sustained(results: list[RunResult]) -> RunResult | None:
    ok = [r for r in results if r.sustained]
    return max(ok, key=lambda r: r.achieved_tok_s) if ok else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="tokenizer dir (default: the tiny model)")
    p.add_argument("--streams", default=None, help="N, or a comma list with --interval-ms")
    p.add_argument("--rates", default=None, help="offered tok/s to sweep (comma list)")
    p.add_argument("--interval-ms", type=float, default=None, help="sweep streams at this")
    p.add_argument("--duration", type=float, default=2.5, help="seconds per configuration")
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--route", default="/generate", choices=["/generate", "/v1/completions"])
    p.add_argument("--parse", default="chunks", choices=["chunks", "lines"])
    p.add_argument("--stop-strings", type=int, default=0, help="never-matching stop strings")
    p.add_argument("--front-cpu", type=int, default=0, help="the front's core (-1: no pinning)")
    p.add_argument(
        "--front-gc",
        default="as-is",
        choices=["as-is", "freeze", "off"],
        help="before the sweep: gc.freeze() or gc.disable() in the front (an experiment)",
    )
    p.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="the front's event loop (radixrt serve --event-loop)",
    )
    p.add_argument("--keep-going", action="store_true", help="run every configuration")
    p.add_argument("--quick", action="store_true", help="64 streams, 3 rates, 1 s each")
    p.add_argument("--profile", action="store_true", help="then profile one configuration")
    p.add_argument("--profile-rate", type=float, default=8000, help="its offered tok/s")
    p.add_argument("--profile-top", type=int, default=0, help="top functions per group")
    p.add_argument("--json", default=None, help="write every result to this file")
    p.add_argument(
        "--compare",
        default=None,
        metavar="DIR",
        help="A/B: also run the front of the radixrt checkout DIR, interleaved (A, B, A, ...)",
    )
    args = p.parse_args()
    default_streams = "64" if args.quick else "256"
    args.streams = [int(x) for x in (args.streams or default_streams).split(",")]
    if args.interval_ms is None and len(args.streams) != 1:
        p.error("--streams takes a list only with --interval-ms (a streams sweep)")
    rates = QUICK_RATES if args.quick else DEFAULT_RATES
    args.rates = [float(x) for x in args.rates.split(",")] if args.rates else rates
    if args.quick:
        args.duration = min(args.duration, 1.0)

    from benchmarks.front_fake_scheduler import token_source
    from benchmarks.front_results import RunConfig
    from benchmarks.front_rig import FrontRig
    from radixrt.hf_dir import load_tokenizer

    if args.model is None:
        from radixrt.model.tiny import ensure_tiny_model

        args.model = ensure_tiny_model()
    tokenizer = load_tokenizer(args.model)
    source = token_source(tokenizer)
    cores = sorted(os.sched_getaffinity(0))
    front_cpus = others = None
    if args.front_cpu >= 0 and len(cores) > 1:
        front_cpus = (args.front_cpu,)
        others = tuple(c for c in cores if c != args.front_cpu)
    load0 = os.getloadavg()
    print(
        f"# bench_front: {platform.node()}, {len(cores)} cores, front on {front_cpus or 'any'}, "
        f"fake scheduler + {args.clients} client processes on {others or 'any'}; "
        f"route {args.route}, client parse {args.parse}, front GC {args.front_gc}, "
        f"event loop {args.event_loop}; "
        f"load average {load0[0]:.2f}",
        flush=True,
    )
    code_dirs: dict[str, str | None] = {"": None}
    if args.compare:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code_dirs = {"A": None, "B": args.compare}
        print(f"# A: the front of {here}; B: the front of {os.path.abspath(args.compare)}")
    labels = bool(args.compare)
    configs = sweep_configs(args)
    t0 = time.perf_counter()
    profiles: dict[str, ProfileResult] = {}
    with contextlib.ExitStack() as stack:
        rigs = {}
        for label, code_dir in code_dirs.items():
            rig = FrontRig(
                args.model, source, len(tokenizer), args.clients, front_cpus, others,
                args.profile, decode=tokenizer.decode, event_loop=args.event_loop,
                code_dir=code_dir,
            )  # fmt: skip
            rigs[label] = stack.enter_context(rig)
        for rig in rigs.values():
            if args.front_gc != "as-is":
                rig.front_gc(args.front_gc)
            c = configs[0]
            rig.run(RunConfig(c.streams, 0.02, MIN_TOKENS, c.route, c.parse, c.stop))  # warm-up
        print(header(labels))
        print(separator(labels))
        results = run_sweep(rigs, configs, args.keep_going)
        if args.profile:
            c = configs[0]
            interval = c.streams / args.profile_rate
            tokens = max(MIN_TOKENS, round(args.duration / interval))
            config = RunConfig(c.streams, interval, tokens, c.route, c.parse, c.stop)
            profiles = {label: rig.profile(config) for label, rig in rigs.items()}
    load1 = os.getloadavg()
    print(f"\n# {time.perf_counter() - t0:.0f} s; load average {load1[0]:.2f} at the end")
    for label, prof in profiles.items():
        print_profile(prof, args.profile_top, label)
    print("\n" + header(labels))
    print(separator(labels))
    for i in range(max(len(rs) for rs in results.values())):
        for label, rs in results.items():
            if i < len(rs):
                print(row(rs[i], label))
    print()
    for label, rs in results.items():
        print_summary(rs, label)
    if args.json:
        with open(args.json, "w") as f:
            out = {
                "results": {label: [asdict(r) for r in rs] for label, rs in results.items()},
                "profile_us_per_token": {k: p.us_per_token() for k, p in profiles.items()},
            }
            json.dump(out, f, indent=1)


def print_summary(results: list[RunResult], label: str) -> None:
    lead = f"{label}: " if label else ""
    top = max(results, key=lambda r: r.achieved_tok_s)
    print(
        f"{lead}highest achieved: {top.achieved_tok_s:,.0f} tok/s ({top.config.streams} "
        f"streams, {1000 * top.config.interval_s:.2f} ms steps, ITL p99 "
        f"{top.itl_token_ms.p99:.1f} ms)"
    )
    noisy = [r for r in results if r.front.wait_s > NOISY_WAIT * r.wall_s]
    if noisy:
        print(
            f"{lead}note: in {len(noisy)} of {len(results)} runs the front waited over "
            f"{100 * NOISY_WAIT:.0f}% of the time for its core (other processes, or its own "
            "ZMQ I/O thread): if the others, noisy numbers"
        )
    best = best_sustained(results)
    if best is None:
        print(f"{lead}no configuration was sustained (ITL p99 <= 2x interval, >= 90% of offered)")
    else:
        print(
            f"{lead}highest sustained: {best.achieved_tok_s:,.0f} tok/s ({best.config.streams} "
            f"streams, {1000 * best.config.interval_s:.2f} ms steps, ITL p99 "
            f"{best.itl_token_ms.p99:.1f} ms)"
        )


if __name__ == "__main__":
    main()
