"""Radix vs block-hash vs no prefix cache on multi-call workloads, side by side in one run.

Every workload (and a memory-pressure variant of some: a KV pool `--pressure-factor` times
smaller than their working set) runs under each configuration on the same requests:
radix+lpm, blockhash+fcfs (vLLM-like) and none+fcfs. Backends:
- engine: the in-process engine (`benchmarks.engine_driver`); one engine per config and
  pool size, its prefix cache reset between workloads (the same as a fresh engine).
- server: a fresh `radixrt serve` per run, driven over streaming POST /generate.
Writes <out>/<tag>.json and <tag>.md (table + targets) after every run, <tag>.png after
every engine (a suite stopped by a timeout keeps what it finished).

    python -m benchmarks.bench_serving --size smoke                    # CPU, tiny model
    python -m benchmarks.bench_serving --size smoke --backend server --workloads shared-prefix
    python -m benchmarks.bench_serving --model DIR --load-format dummy --scale 0.25
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from benchmarks.backends import EngineBackend, ServerBackend, engine_options
from benchmarks.host_tier import format_host_table
from benchmarks.metrics import DriverResult, format_table, save_results, summarize, targets_markdown
from benchmarks.plot import plot_runs
from benchmarks.targets import check_targets
from benchmarks.workloads import DEFAULT_WORKLOADS, WORKLOADS, Workload, make_workload

CONFIGS = {  # short name -> (prefix cache, scheduling policy); "<cache>+<policy>" also works
    "radix": ("radix", "lpm"),
    "radix-host": ("radix-host", "lpm"),  # radix + a host KV tier of --host-kv-gb
    "blockhash": ("blockhash", "fcfs"),
    "none": ("none", "fcfs"),
}


@dataclass(frozen=True)
class RunSpec:
    label: str  # table name: the workload, or "<workload>@kv/<ratio>" under pressure
    workload: Workload
    num_kv_blocks: int | None  # None: the engine's default pool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: the tiny model)")
    p.add_argument("--backend", default="engine", choices=["engine", "server"])
    p.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"comma list of {', '.join(WORKLOADS)}",
    )
    p.add_argument("--pressure", default="multi-turn,agent", help="workloads to rerun under "
                   "memory pressure (comma list; empty: none)")  # fmt: skip
    p.add_argument("--pressure-factor", type=float, default=3.0,
                   help="working set / KV pool of the pressure runs")  # fmt: skip
    p.add_argument("--configs", default="radix,blockhash,none", help="comma list of radix, "
                   "blockhash, none, radix-host (radix + a host KV tier of --host-kv-gb) or "
                   "<cache>+<policy> (e.g. blockhash+lpm, radix-host+fcfs)")  # fmt: skip
    p.add_argument("--size", default="full", choices=["full", "smoke"])
    p.add_argument("--scale", default="1", help="session-count factor: X, or name=X,... "
                   "(workloads not named keep 1)")  # fmt: skip
    p.add_argument("--order", default="config", choices=["config", "workload"],
                   help="loop order of the runs (see _blocks)")  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="runs per workload and config; "
                   "the median run is reported, with the spread of all")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--agent-tool-calls", action="store_true", help="the agent workload's "
                   "steps as tool calls and tool messages (workloads.agent)")  # fmt: skip
    p.add_argument("--tool-pause-s", type=float, default=0.0, help="agent: seconds between a "
                   "step's answer and the next step (a tool runs meanwhile)")  # fmt: skip
    p.add_argument("--cache-ttl-s", default="0", help="retention hints to run (engine backend), "
                   "comma list: every call a later call extends asks `cache_ttl_s` X; a "
                   "program's holds end with it; 0: no hints")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=None, help="programs in flight")
    p.add_argument("--request-rate", type=float, default=math.inf, help="programs per second")
    p.add_argument("--run-timeout-s", type=float, default=None, help="abort a run after this")
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--tag", default="serving", help="name of the output files")
    p.add_argument("--hf-baseline", default=None, help="bench_hf JSON for the 10x target")
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="pool of the normal runs")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    g.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8 W8A8 linears (dummy / 16-bit weights quantized at load)")  # fmt: skip
    g.add_argument("--fp8-activation-scale", default="auto", choices=["auto", "token", "tensor"])
    g.add_argument(
        "--host-kv-gb",
        type=float,
        default=1.0,
        help="host KV tier of the radix-host config (GiB, the same in every run)",
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--aging-tokens-per-step", type=float, default=None,
                   help="lpm aging (engine default when unset)")  # fmt: skip
    g.add_argument("--disable-cuda-graph", action="store_true")
    g.add_argument("--disable-overlap-schedule", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (also for "
                   "servers); 1 is robust on a shared, oversubscribed CPU")  # fmt: skip
    g.add_argument("--server-startup-timeout-s", type=float, default=600.0)
    return p.parse_args(argv)


def _scales(spec: str, names: list[str]) -> dict[str, float]:
    if "=" not in spec:
        return dict.fromkeys(names, float(spec))
    scales = dict.fromkeys(names, 1.0)
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name not in WORKLOADS:
            raise ValueError(f"--scale: unknown workload {name!r}; allowed: {WORKLOADS}")
        scales[name] = float(value)
    return scales


def plan_runs(args: argparse.Namespace, vocab_size: int, max_len: int) -> list[RunSpec]:
    """Normal runs of every workload, then the pressure runs, which share one pool: the
    smallest of (working set / pressure factor) over the pressure workloads."""
    names = [n for n in args.workloads.split(",") if n]
    pressure = [n for n in args.pressure.split(",") if n]
    scales = _scales(args.scale, sorted(set(names) | set(pressure)))
    agent: dict = {}
    if args.agent_tool_calls:
        agent["tool_calls"] = True
    if args.tool_pause_s > 0:
        agent["tool_pause_s"] = args.tool_pause_s
    extra = {"agent": agent}
    workloads = {
        n: make_workload(n, args.size, scales[n], args.seed, vocab_size, **extra.get(n, {}))
        for n in dict.fromkeys(names + pressure)
    }
    for w in workloads.values():
        if w.max_context > max_len:
            raise ValueError(
                f"workload {w.name} needs {w.max_context} tokens of context but the model "
                f"allows {max_len}; use --size smoke or a longer-context model"
            )
    runs = [RunSpec(n, workloads[n], args.num_kv_blocks) for n in names]
    bs = args.block_size
    pools = {
        n: max(
            math.ceil(working_set_blocks(workloads[n], bs, args.max_concurrency)
                      / args.pressure_factor),
            2 * math.ceil(workloads[n].max_context / bs),
        )
        for n in pressure
    }  # fmt: skip
    if pools:
        pool = min(pools.values())
        for n in pressure:
            ratio = working_set_blocks(workloads[n], bs, args.max_concurrency) / pool
            runs.append(RunSpec(f"{n}@kv/{ratio:.1f}", workloads[n], pool))
    return runs


def working_set_blocks(w: Workload, block_size: int, max_concurrency: int | None) -> int:
    return math.ceil(w.working_set_tokens(max_concurrency) / block_size)


def run_suite(args: argparse.Namespace, command: str = "") -> dict:
    """Run the plan under every config; returns (and keeps writing) the results dict."""
    from radixrt.config import ModelConfig

    model = args.model
    if model is None:
        from radixrt.model.tiny import ensure_tiny_model

        model = ensure_tiny_model()
    mc = ModelConfig.from_pretrained(model)
    runs = plan_runs(args, mc.vocab_size, mc.max_position_embeddings)
    configs = [parse_config(c) for c in args.configs.split(",") if c]
    ttls = parse_ttls(args.cache_ttl_s, args.backend)
    os.makedirs(args.out, exist_ok=True)
    hf = None
    if args.hf_baseline:
        with open(args.hf_baseline) as f:
            hf = json.load(f)
    results = {"meta": _meta(args, model, command), "hf_baseline": hf, "runs": [],
               "targets": [], "all_runs": []}  # fmt: skip
    backend = EngineBackend if args.backend == "engine" else ServerBackend
    title = f"{args.tag}: {os.path.basename(model.rstrip('/'))}, {args.backend} backend"
    total = args.repeat * len(configs) * len(ttls) * sum(r.workload.num_calls for r in runs)
    bar = tqdm(total=total, unit="call", dynamic_ncols=True, mininterval=0.5 if
               sys.stderr.isatty() else 10)  # fmt: skip
    for config, kv, specs in _blocks(runs, configs, args.order, args.repeat):
        cache, policy = config
        with backend(args, model, engine_options(args, cache, policy, kv)) as b:
            for spec, ttl in ((s, t) for s in specs for t in ttls):
                bar.set_description(
                    f"{spec.label} {cache}+{policy}" + (f" ttl {ttl:g}" if ttl else "")
                )
                result = b.run(spec.workload, lambda: bar.update(1), cache_ttl_s=ttl)
                row = _row(spec, config, args.backend, result, ttl)
                results["all_runs"].append(row)
                results["runs"] = median_runs(results["all_runs"])
                bar.write(_one_line(row))
                _write(results, args)
        try:
            plot_runs(results["runs"], os.path.join(args.out, f"{args.tag}.png"), title)
        except ImportError as e:  # the GPU image has no matplotlib: plot the JSON later
            bar.write(f"no plot ({e}); later: python -m benchmarks.plot {args.out}/{args.tag}.json")
    bar.close()
    return results


def _blocks(
    runs: list[RunSpec], configs: list[tuple[str, str]], order: str, repeat: int
) -> list[tuple[tuple[str, str], int | None, list[RunSpec]]]:
    """(config, KV pool, runs) per backend instance. config: one engine per config and pool,
    all its runs in a row; workload: one per run, each workload's configs back to back,
    `repeat` rounds in turn (less drift between configs on a shared machine)."""
    if order == "workload":
        return [(c, r.num_kv_blocks, [r]) for r in runs for _ in range(repeat) for c in configs]
    pools = dict.fromkeys(r.num_kv_blocks for r in runs)
    return [
        (c, kv, [r for r in runs if r.num_kv_blocks == kv for _ in range(repeat)])
        for c in configs
        for kv in pools
    ]


def median_runs(rows: list[dict]) -> list[dict]:
    """The run of median duration of each (workload, config) among its complete runs, with
    every repeat's duration in `repeat_durations_s` and (max - min) / median in
    `duration_spread`, grouped by workload. Single runs on a shared CPU differ by up to 2x:
    compare medians and read the spread."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["config"]), []).append(r)
    picked = []
    for _, group in sorted(
        groups.items(), key=lambda kv: (workloads.index(kv[0][0]), configs.index(kv[0][1]))
    ):
        done = sorted([r for r in group if r["complete"]] or group, key=lambda r: r["duration_s"])
        pick = done[(len(done) - 1) // 2]
        durations = [r["duration_s"] for r in done]
        spread = (durations[-1] - durations[0]) / pick["duration_s"] if pick["duration_s"] else 0
        picked.append(
            {
                **pick,
                "repeat_durations_s": [r["duration_s"] for r in group],
                "duration_spread": spread,
            }
        )
    return picked


def parse_config(name: str) -> tuple[str, str]:
    """Config name -> (cache, policy): radix, blockhash, none or <cache>+<policy>."""
    from radixrt.config import POLICIES, PREFIX_CACHES

    cache, _, policy = name.partition("+")
    if not policy and cache in CONFIGS:
        return CONFIGS[cache]
    if cache not in (*PREFIX_CACHES, "radix-host") or policy not in POLICIES:
        raise ValueError(
            f"unknown config {name!r}: use {', '.join(CONFIGS)} or <cache>+<policy> with a "
            f"cache in {PREFIX_CACHES} and a policy in {POLICIES}"
        )
    return cache, policy


def parse_ttls(value: str, backend: str) -> list[float]:
    """--cache-ttl-s: the retention hints to run, each >= 0 (the in-process engine only)."""
    try:
        ttls = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--cache-ttl-s: a comma list of seconds, got {value!r}") from None
    if not ttls or any(not (t >= 0 and math.isfinite(t)) for t in ttls):
        raise ValueError(f"--cache-ttl-s: seconds >= 0, got {value!r}")
    if backend != "engine" and any(ttls):
        raise ValueError("--cache-ttl-s needs --backend engine")
    return ttls


def _row(
    spec: RunSpec, config: tuple[str, str], backend: str, result: DriverResult, ttl: float = 0.0
) -> dict:
    cache, policy = config
    return {
        "workload": spec.label,
        "workload_name": spec.workload.name,
        "config": f"{cache}+{policy}" + (f"+ttl{ttl:g}" if ttl else ""),
        "cache": cache,
        "policy": policy,
        "cache_ttl_s": ttl,
        "backend": backend,
        "num_kv_blocks": spec.num_kv_blocks,
        "num_programs": len(spec.workload.programs),
        "best_hit_rate": spec.workload.best_hit_rate(),
        "workload_params": spec.workload.params,
        **summarize(result),
    }


def _one_line(r: dict) -> str:
    return (
        f"{r['workload']:>22} {r['config']:>15}: {r['duration_s']:7.2f} s, "
        f"{r['request_throughput']:8.2f} req/s, {r['output_throughput']:8.0f} out tok/s, "
        f"hit {100 * r['hit_rate']:5.1f}% (best {100 * r['best_hit_rate']:.1f}%), "
        f"evicted {r['evicted_blocks']}, preempted {r['preemptions']}"
        + (f", host hits {r['host_hit_tokens']}" if r.get("host_hit_tokens") else "")
        + f", ITL p50/p99 {r['itl_ms']['p50']:.2f}/{r['itl_ms']['p99']:.1f} ms"
        + f" (after admission {r['itl_after_admission_ms']['p99']:.1f})"
        + (
            f", client {r['client_cpu_us_per_token']:.1f} us CPU/token"
            if r.get("client_cpu_us_per_token")
            else ""
        )
        + ("" if r["complete"] else "  TIMEOUT")
    )


def _write(results: dict, args: argparse.Namespace) -> None:
    """Save the JSON and the markdown table + targets (after every run: a suite killed by
    a timeout keeps what it finished)."""
    # the targets are ratios of full-size runs; a smoke run is too short for them to mean
    # anything (a few requests, timings of milliseconds), so none are checked there
    full = args.size == "full"
    results["targets"] = check_targets(results["runs"], results["hf_baseline"]) if full else []
    markdown = format_table(results["runs"]) + "\n\n" + targets_markdown(results["targets"]) + "\n"
    host = format_host_table(results["runs"])
    save_results(args.out, args.tag, results, markdown + ("\n" + host + "\n" if host else ""))


def _meta(args: argparse.Namespace, model: str, command: str) -> dict:
    import torch

    device = "cpu"
    if torch.cuda.is_available() and args.device != "cpu":
        device = torch.cuda.get_device_name()
    finite = lambda v: str(v) if isinstance(v, float) and not math.isfinite(v) else v
    return {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": device,
        "torch": torch.__version__,
        "model": model,
        "args": {k: finite(v) for k, v in vars(args).items()},
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # servers started from here
    results = run_suite(args, shlex.join(["python", "-m", "benchmarks.bench_serving", *argv]))
    print()
    print(format_table(results["runs"]))
    host = format_host_table(results["runs"])
    if host:
        print("\n" + host)
    print()
    for t in results["targets"]:
        print(f"{t['status']:>4}  {t['text']}")
    if args.size != "full":
        print(f"targets: checked at --size full only (not at --size {args.size})")
    print(f"\nwrote {os.path.join(args.out, args.tag)}.{{json,md,png}}")


if __name__ == "__main__":
    main()
