"""Data-parallel replicas behind sglang-router: prefix-cache hit rate and throughput per policy.

For each workload, the same requests (streaming POST /generate) go to:
- single: one `radixrt serve` whose KV pool is the replicas' total (the reference);
- one `radixrt serve --dp N` per router policy (cache_aware, round_robin, power_of_two), each
  replica with 1/N of that pool (`--num-kv-blocks`, so replicas may share a GPU).
Every server is fresh; its replicas are warmed up directly and their caches flushed before the
run. Hit rates are the replicas' own counters (GET /metrics on each replica:
radixrt_cached_tokens_total / radixrt_prompt_tokens_total, differences over the run, summed);
the client's sum of meta_info cached_tokens is kept beside them as a cross-check. With
`--router-args "--log-level debug"`, cache_aware rows also count the router's spills (requests
it sent by load, not by prefix: its "Load balancing triggered" lines during the run).

Workloads (seeded random token ids, ignore_eos, `benchmarks/workloads.py` generators):
- shared-prefix: G prefix groups (a long system prompt each) x P questions, the G x P requests
  in random order (each group's requests spread over the run), at most C in flight;
- multi-turn: chats (a short system prompt shared by all users, 4 turns), every user at once.
The pool is sized from the working set W (shared-prefix: every group's prefix plus the blocks
of the requests in flight; multi-turn: every conversation's final context): total = W /
--kv-fit, so the working set fits once across the replicas but not in each replica, which a
policy that spreads a group or a conversation over replicas needs.

    python -m benchmarks.bench_router --size smoke --replicas 2            # CPU, tiny model
    python -m benchmarks.bench_router --size full --model DIR --load-format dummy \\
        --device cuda --dtype bfloat16 --replicas 2                        # see run_h200_router.sh
Writes <out>/<tag>.json and <tag>.md after every run; prints the table and the targets.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import shlex
import sys
import time
import urllib.request
from dataclasses import replace

import numpy as np

from benchmarks.backends import warmup_workload
from benchmarks.http_driver import ServerProcess, parse_prometheus, run_server
from benchmarks.metrics import save_results, summarize, targets_markdown
from benchmarks.workloads import Workload, make_workload

POLICIES = ("cache_aware", "round_robin", "power_of_two")  # sglang-router's --policy
SINGLE = "single"  # one server with the replicas' total KV
# per workload and size: generator arguments and programs in flight (None: all at once)
SIZES: dict[str, dict[str, tuple[dict, int | None]]] = {
    "shared-prefix": {
        "smoke": (dict(num_groups=16, prompts_per_group=8, system_len=256, question_len=16,
                       output_len=8), 8),
        "full": (dict(num_groups=64, prompts_per_group=16, system_len=2048, question_len=128,
                      output_len=64), 64),
    },
    "multi-turn": {
        "smoke": (dict(num_users=16, num_turns=4, system_len=32, input_len=(32, 64),
                       output_lens=(8, 32)), None),
        "full": (dict(num_users=64, num_turns=4, system_len=128, input_len=(256, 512),
                      output_lens=(8, 256)), None),
    },
}  # fmt: skip
REPLICA_LINE = re.compile(r"replica (\d+): (http://127\.0\.0\.1:\d+) \(pid \d+")
SPILL_LINE = "Load balancing triggered"  # sglang-router's debug line per imbalanced decision
HIT_TARGET = 0.95  # cache_aware's hit rate / single's
THROUGHPUT_TARGET = 1.5  # cache_aware's request throughput / round_robin's (shared-prefix)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: the tiny model)")
    p.add_argument("--replicas", type=int, default=2, help="N: replicas behind the router")
    p.add_argument("--workloads", default="shared-prefix,multi-turn", help="comma list of "
                   f"{', '.join(SIZES)}")  # fmt: skip
    p.add_argument("--configs", default=",".join((SINGLE, *POLICIES)), help=f"comma list of "
                   f"{SINGLE} and router policies ({', '.join(POLICIES)})")  # fmt: skip
    p.add_argument("--size", default="smoke", choices=["smoke", "full"])
    p.add_argument("--scale", type=float, default=1.0, help="x groups / users")
    p.add_argument("--per-group", type=int, default=None, help="shared-prefix: requests per "
                   "group (default: the size's; with --scale 1/G: one hot prefix)")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="programs in flight (default: the size's, see SIZES)")  # fmt: skip
    p.add_argument("--kv-fit", type=float, default=0.75, help="working set / total KV pool "
                   "of the replicas (<= 1: fits once)")  # fmt: skip
    p.add_argument("--router-args", default="", help="more sglang-router options for every "
                   "policy (after those `serve --dp` passes)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout-s", type=float, default=None, help="abort a run after this")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--tag", default="router")
    g = p.add_argument_group("servers (every replica and the single server)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--serve-args", default="", help="more `radixrt serve` options, one string")
    return p.parse_args(argv)


def make_router_workload(
    name: str, size: str, scale: float, seed: int, vocab: int, per_group: int | None = None
) -> Workload:
    """The workload `name` at `size`; shared-prefix's requests in a seeded random order
    (`per_group`: its requests per group instead of the size's)."""
    params, _ = SIZES[name][size]
    if name == "shared-prefix" and per_group is not None:
        params = {**params, "prompts_per_group": per_group}
    w = make_workload(name, size, scale, seed, vocab, **params)
    if name == "shared-prefix":
        order = np.random.default_rng(seed).permutation(len(w.programs))
        w = replace(w, programs=tuple(w.programs[i] for i in order), params={**w.params,
                    "order": "random"})  # fmt: skip
    return w


def working_set_blocks(w: Workload, block_size: int, concurrency: int | None) -> int:
    """KV blocks the workload keeps: shared-prefix, every group's system prompt plus the
    unshared blocks of the requests in flight; otherwise every program's tree (each with a
    partial last block)."""
    bs = block_size
    if w.name == "shared-prefix":
        p = w.params
        shared = p["num_groups"] * math.ceil(p["system_len"] / bs)
        in_flight = min(concurrency or len(w.programs), len(w.programs))
        own = math.ceil((p["question_len"] + p["output_len"]) / bs) + 1
        return shared + in_flight * own
    return sum(math.ceil(prog.unique_tokens() / bs) + 1 for prog in w.programs)


def replica_metrics(url: str) -> dict[str, float]:
    """The counters of one replica's GET /metrics that a run's figures are differences of."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        m = parse_prometheus(resp.read().decode())
    requests = sum(v for k, v in m.items() if k.startswith("radixrt_requests_total{"))
    return {
        "requests": requests,
        "prompt_tokens": m["radixrt_prompt_tokens_total"],
        "cached_tokens": m["radixrt_cached_tokens_total"],
        "generated_tokens": m["radixrt_generated_tokens_total"],
        "prompt_tokens_computed": m["radixrt_prompt_tokens_computed"],
        "evicted_blocks": m["radixrt_evicted_blocks"],
        "preemptions": m["radixrt_preemptions"],
    }


def flush_cache(url: str) -> None:
    req = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200, f"{url}/flush_cache: HTTP {resp.status}"


def wait_for_line(path: str, pattern: str, proc_alive, timeout_s: float) -> str:
    """The log's text once `pattern` is in it; RuntimeError when the server exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open(path, errors="replace") as f:
            text = f.read()
        if pattern in text:
            return text
        if not proc_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"no {pattern!r} in {path}:\n{text[-3000:]}")
        time.sleep(0.25)


def serve_args(args: argparse.Namespace, config: str, kv_blocks: int) -> list[str]:
    """`radixrt serve` options of `config` (single: the whole pool; a policy: N replicas of
    `kv_blocks` each behind the router with that policy)."""
    out = [
        "--device", args.device, "--dtype", args.dtype, "--load-format", args.load_format,
        "--block-size", str(args.block_size), "--max-running-requests",
        str(args.max_running_requests), *shlex.split(args.serve_args),
        "--incremental-streaming-output",  # deltas: less to send than SGLang's cumulative ids
    ]  # fmt: skip
    if config == SINGLE:
        return [*out, "--num-kv-blocks", str(kv_blocks * args.replicas)]
    router = f"{args.router_args} --policy {config}".strip()
    return [*out, "--num-kv-blocks", str(kv_blocks), "--dp", str(args.replicas),
            "--log-level", "info", "--router-args", router]  # fmt: skip


def _router_debug(args: argparse.Namespace) -> bool:
    opts = shlex.split(args.router_args)
    levels = [opts[i + 1] for i, o in enumerate(opts[:-1]) if o == "--log-level"]
    return bool(levels) and levels[-1] == "debug"


def run_one(
    args: argparse.Namespace, model: str, w: Workload, config: str, kv_blocks: int,
    concurrency: int | None,
) -> dict:  # fmt: skip
    """One fresh server (or router + replicas) for one workload; the result row."""
    log = os.path.join(args.out, f"{args.tag}-{w.name}-{config}.log")
    with open(log, "w"):
        pass
    opts = serve_args(args, config, kv_blocks)
    vocab = w.params["vocab_size"]
    t0 = time.monotonic()
    with ServerProcess(model, opts, log, args.startup_timeout_s) as srv:
        if config == SINGLE:
            replicas = [srv.url]
        else:
            text = wait_for_line(log, "serving on", lambda: srv.proc.poll() is None,
                                 args.startup_timeout_s)  # fmt: skip
            replicas = [u for _, u in sorted((int(i), u) for i, u in REPLICA_LINE.findall(text))]
            assert len(replicas) == args.replicas, f"replicas in {log}: {replicas}"
        startup_s = time.monotonic() - t0
        for url in replicas:  # every replica warmed (a policy may skip one), then emptied
            run_server(url, warmup_workload(vocab), server_stats=False)
        if config != SINGLE:
            run_server(srv.url, warmup_workload(vocab), server_stats=False)  # the router's path
        for url in replicas:
            flush_cache(url)
        before = [replica_metrics(u) for u in replicas]
        log_offset = os.path.getsize(log)
        result = run_server(
            srv.url, w, max_concurrency=concurrency, seed=args.seed,
            timeout_s=args.run_timeout_s, server_stats=False,
        )  # fmt: skip
        time.sleep(0.5)  # the scheduler gauges follow its snapshots
        after = [replica_metrics(u) for u in replicas]
    with open(log, errors="replace") as f:
        f.seek(log_offset)
        spills = f.read().count(SPILL_LINE)
    per_replica = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    prompt = sum(r["prompt_tokens"] for r in per_replica)
    cached = sum(r["cached_tokens"] for r in per_replica)
    s = summarize(result)
    return {
        "workload": w.name,
        "config": config,
        "replicas": 1 if config == SINGLE else args.replicas,
        "kv_blocks_per_replica": kv_blocks * args.replicas if config == SINGLE else kv_blocks,
        "max_concurrency": concurrency,
        "num_programs": len(w.programs),
        "best_hit_rate": w.best_hit_rate(),
        "workload_params": w.params,
        "startup_s": startup_s,
        "hit_rate": cached / prompt if prompt else 0.0,  # the replicas' counters
        "client_hit_rate": s["hit_rate"],  # meta_info cached_tokens, for comparison
        "per_replica": per_replica,
        "requests_per_replica": [int(r["requests"]) for r in per_replica],
        "hit_rate_per_replica": [
            r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
            for r in per_replica
        ],
        "prompt_tokens_computed": sum(r["prompt_tokens_computed"] for r in per_replica),
        "evicted_blocks": sum(r["evicted_blocks"] for r in per_replica),
        "preemptions": sum(r["preemptions"] for r in per_replica),
        # cache_aware's routing decisions made by load (imbalanced); the router logs them at
        # debug level only: None unless --router-args has --log-level debug
        "router_spills": spills if config == "cache_aware" and _router_debug(args) else None,
        **{k: s[k] for k in ("complete", "num_calls", "duration_s", "request_throughput",
                             "input_throughput", "output_throughput", "ttft_ms", "e2e_ms")},
    }  # fmt: skip


def check_targets(rows: list[dict], full_gpu: bool) -> list[dict]:
    """cache_aware's hit rate >= 95% of single's (every workload); its throughput >= 1.5x
    round_robin's on shared-prefix (full size on a GPU only: CPU throughput is noise)."""
    by = {(r["workload"], r["config"]): r for r in rows}
    out = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        ca, single, rr = (by.get((wl, c)) for c in ("cache_aware", SINGLE, "round_robin"))
        if ca and single and single["hit_rate"] > 0:
            ratio = ca["hit_rate"] / single["hit_rate"]
            out.append(_target(ratio >= HIT_TARGET, f"{wl}: cache_aware hit rate "
                               f"{100 * ca['hit_rate']:.1f}% = {ratio:.3f} x single's "
                               f"{100 * single['hit_rate']:.1f}% (>= {HIT_TARGET})"))  # fmt: skip
        if wl == "shared-prefix" and ca and rr:
            ratio = ca["request_throughput"] / rr["request_throughput"]
            text = (f"{wl}: cache_aware throughput {ratio:.2f} x round_robin's "
                    f"(>= {THROUGHPUT_TARGET})")  # fmt: skip
            skip = {"status": "SKIP", "text": text + ": checked at --size full on a GPU"}
            out.append(_target(ratio >= THROUGHPUT_TARGET, text) if full_gpu else skip)
    return out


def _one_line(r: dict) -> str:
    return (
        f"{r['workload']:>14} {r['config']:>13}: {r['duration_s']:6.2f} s (start "
        f"{r['startup_s']:.0f} s), {r['request_throughput']:7.2f} req/s, hit "
        f"{100 * r['hit_rate']:.1f}% (client {100 * r['client_hit_rate']:.1f}%, best "
        f"{100 * r['best_hit_rate']:.1f}%), requests per replica {r['requests_per_replica']}"
        + ("" if r.get("router_spills") is None else f", spills {r['router_spills']}")
    )


def _target(ok: bool, text: str) -> dict:
    return {"status": "PASS" if ok else "FAIL", "text": text}


TABLE_HEADER = (
    "| workload | config | KV blocks / replica | req/s | out tok/s | TTFT p50/p99 ms "
    "| hit % (best) | x single hit | x round_robin req/s | requests per replica "
    "| hit % per replica | evicted | preempt | spills |"
)


def format_table(rows: list[dict]) -> str:
    single = {r["workload"]: r["hit_rate"] for r in rows if r["config"] == SINGLE}
    rr = {r["workload"]: r["request_throughput"] for r in rows if r["config"] == "round_robin"}
    lines = [TABLE_HEADER, "|" + "---|" * (TABLE_HEADER.count("|") - 1)]
    for r in rows:
        wl = r["workload"]
        x_hit = f"{r['hit_rate'] / single[wl]:.3f}" if single.get(wl) else "-"
        x_rr = f"{r['request_throughput'] / rr[wl]:.2f}" if rr.get(wl) else "-"
        ttft = r["ttft_ms"]
        lines.append(
            f"| {wl}{'' if r['complete'] else ' TIMEOUT'} | {r['config']} "
            f"| {r['kv_blocks_per_replica']} | {r['request_throughput']:.2f} "
            f"| {r['output_throughput']:.0f} | {ttft['p50']:.0f}/{ttft['p99']:.0f} "
            f"| {100 * r['hit_rate']:.1f} ({100 * r['best_hit_rate']:.1f}) | {x_hit} | {x_rr} "
            f"| {' / '.join(map(str, r['requests_per_replica']))} "
            f"| {' / '.join(f'{100 * h:.0f}' for h in r['hit_rate_per_replica'])} "
            f"| {r['evicted_blocks']:.0f} | {r['preemptions']:.0f} "
            f"| {'-' if r.get('router_spills') is None else r['router_spills']} |"
        )
    return "\n".join(lines)


def _write(results: dict, args: argparse.Namespace) -> None:
    markdown = format_table(results["runs"]) + "\n\n" + targets_markdown(results["targets"]) + "\n"
    save_results(args.out, args.tag, results, markdown)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from radixrt.config import ModelConfig

    model = args.model
    if model is None:
        from radixrt.model.tiny import ensure_tiny_model

        model = ensure_tiny_model()
    vocab = ModelConfig.from_pretrained(model).vocab_size
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c != SINGLE and c not in POLICIES:
            raise ValueError(f"unknown config {c!r}; allowed: {SINGLE}, {', '.join(POLICIES)}")
    os.makedirs(args.out, exist_ok=True)
    full_gpu = args.size == "full" and args.device != "cpu"
    results = {
        "meta": {
            "command": shlex.join(["python", "-m", "benchmarks.bench_router", *argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "model": model,
            "args": vars(args),
        },
        "runs": [],
        "targets": [],
    }
    for name in [n for n in args.workloads.split(",") if n]:
        if name not in SIZES:
            raise ValueError(f"unknown workload {name!r}; allowed: {', '.join(SIZES)}")
        w = make_router_workload(name, args.size, args.scale, args.seed, vocab, args.per_group)
        concurrency = args.max_concurrency or SIZES[name][args.size][1]
        ws = working_set_blocks(w, args.block_size, concurrency)
        kv = math.ceil(ws / args.kv_fit / args.replicas)
        print(
            f"== {name}: {len(w.programs)} programs, {w.num_calls} calls, working set {ws} "
            f"blocks, {kv} blocks per replica ({kv * args.replicas} in all)",
            flush=True,
        )
        for config in configs:
            row = run_one(args, model, w, config, kv, concurrency)
            results["runs"].append(row)
            results["targets"] = check_targets(results["runs"], full_gpu)
            _write(results, args)
            print(_one_line(row), flush=True)
    print()
    print(format_table(results["runs"]))
    print()
    for t in results["targets"]:
        print(f"{t['status']:>4}  {t['text']}")
    print(f"\nwrote {os.path.join(args.out, args.tag)}.{{json,md}}")


if __name__ == "__main__":
    main()
