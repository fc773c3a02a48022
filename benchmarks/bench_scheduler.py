"""Scheduler-only simulation: a workload through the real scheduler and prefix cache with the
model stubbed out (every forward returns a fixed token at once). Counts steps, computed
tokens, preemptions, evictions and hit rate, which is what separates caches and policies
under memory pressure, in seconds on a CPU and independent of GPU timing noise.

    python -m benchmarks.bench_scheduler --workload agent --num-kv-blocks 575 \
        --configs radix+lpm,blockhash+lpm,blockhash+fcfs

`--step-s` runs on a virtual clock: each step takes `--step-s` plus `--token-s` per token it
computes (a cost model: recomputed prompts then cost time), so `duration` and the calls'
end-to-end latency (`e2e`, submit to last token) compare settings.

Retention hints (agents pausing for tool calls while others fill the pool): each config runs
once per `--cache-ttl-s` value; `recomputed` is the prompt tokens computed beyond the
workload's minimum (every prompt token an ideal cache could not have served). A program's
holds are released when its last call finishes. `--kv-ratio 3` sizes the pool to a third of
the workload's working set (every program's KV tree, as bench_serving's pressure runs).

    python -m benchmarks.bench_scheduler --workload agent --scale 0.25 --tool-pause-s 0.2 \
        --request-rate 5 --step-s 0.001 --kv-ratio 3 --configs radix+lpm --cache-ttl-s 0,5
"""

from __future__ import annotations

import argparse
import math
import time

from benchmarks.engine_driver import run_engine
from benchmarks.workloads import WORKLOADS, interleave, make_workload
from radixrt.config import ModelConfig, resolve_config
from radixrt.engine.core import EngineCore
from radixrt.model.tiny import ensure_tiny_model
from radixrt.testing import ScriptedRunner


class StepClock:
    """Virtual time for the simulation: each executed step takes `step_s` seconds, sleeping
    skips ahead; the driver's pacing, tool pauses and retention hints all read it, so a run is
    deterministic whatever the machine's load."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def simulate(
    workload,
    cache: str,
    policy: str,
    num_kv_blocks: int,
    block_size: int,
    host_blocks: int = 0,
    cache_ttl_s: float = 0.0,
    request_rate: float = math.inf,
    step_s: float = 0.0,
    token_s: float = 0.0,
    holds: list[bool] | None = None,
    **options,
) -> dict:
    """`cache` radix-host: radix with a host KV tier of `host_blocks` blocks; `cache_ttl_s`:
    every call's retention hint; `request_rate`: programs per second (inf: all at once);
    `step_s` > 0: virtual time, each step taking that long plus `token_s` per token it
    computes (`StepClock`); 0: wall time; `holds`: per program, whether it asks for holds
    (run_engine); the calls of the others are timed apart (`other_*`);
    `options`: more engine options (resolve_config)."""
    model_dir = ensure_tiny_model(random=True)  # only its shape is used: it never runs
    host = {"num_host_kv_blocks": host_blocks} if cache == "radix-host" else {}
    cfg = resolve_config(
        model_dir,
        device="cpu",
        detect_devices=False,
        prefix_cache="radix" if cache == "radix-host" else cache,
        policy=policy,
        block_size=block_size,
        max_model_len=1 << 20,
        **host,
        **options,
    )
    runner = ScriptedRunner(cfg.scheduler.max_running_requests, block_size, lambda rid, pos: 11)
    core = EngineCore(
        cfg, ModelConfig.from_pretrained(model_dir), [], runner=runner, num_kv_blocks=num_kv_blocks
    )
    timing = {}
    if step_s > 0:
        clock = StepClock(step_s)
        core.scheduler.retention.clock = clock
        execute = runner.execute

        def timed(plan):
            clock.sleep(step_s + token_s * sum(row.num_tokens for row in plan.rows))
            return execute(plan)

        runner.execute = timed
        timing = {"clock": clock, "sleep": clock.sleep}
    start = time.perf_counter()
    result = run_engine(
        core, workload, cache_ttl_s=cache_ttl_s, request_rate=request_rate, holds=holds, **timing
    )
    core.check_integrity()

    def held(r) -> bool:
        return holds is None or holds[r.program]

    other = [r for r in result.records if not held(r)]
    e2e = sorted(r.end - r.submit for r in result.records if held(r))
    other_e2e = sorted(r.end - r.submit for r in other)
    stats = core.stats()
    minimum = math.ceil(workload.prompt_tokens * (1 - workload.best_hit_rate()))
    return {
        "prompt_computed": stats["prompt_tokens_computed"],
        "recomputed": stats["prompt_tokens_computed"] - minimum,
        "steps": stats["steps"],
        "computed_tokens": runner.num_computed_tokens,
        "preemptions": stats["preemptions"],
        "retention_holds": stats["retention_holds"],
        "evicted_blocks": stats["evicted_blocks"],
        "hit_rate": stats["cache_hit_rate"],
        "host_hit_tokens": stats["host_hit_tokens"],
        "loaded_blocks": stats["host_loaded_blocks"],
        "written_back_blocks": stats["host_written_back_blocks"],
        "duration_s": result.duration_s,  # virtual with step_s > 0
        "e2e_mean_s": sum(e2e) / len(e2e) if e2e else 0.0,
        "e2e_p50_s": e2e[len(e2e) // 2] if e2e else 0.0,
        "other_e2e_mean_s": sum(other_e2e) / len(other_e2e) if other_e2e else 0.0,
        "other_e2e_p90_s": other_e2e[len(other_e2e) * 9 // 10] if other_e2e else 0.0,
        "other_computed": sum(r.prompt_tokens - r.cached_tokens for r in other),
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="agent", choices=WORKLOADS)
    p.add_argument("--size", default="full", choices=["full", "smoke"])
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--num-kv-blocks", type=int, default=575)
    p.add_argument("--kv-ratio", type=float, default=None, help="pool = working set / this "
                   "(overrides --num-kv-blocks)")  # fmt: skip
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--configs",
        default="radix+lpm,radix+fcfs,blockhash+lpm,blockhash+fcfs",
        help="<cache>+<policy>; cache radix-host: radix + --num-host-kv-blocks",
    )
    p.add_argument("--num-host-kv-blocks", type=int, default=8192)
    p.add_argument("--tool-pause-s", type=float, default=0.0, help="agent: pause per tool call")
    p.add_argument("--cache-ttl-s", default="0", help="retention hints to run, comma-separated")
    p.add_argument("--retention-max-share", type=float, default=None, help="default: the "
                   "engine's")  # fmt: skip
    p.add_argument(
        "--mix",
        choices=WORKLOADS,
        help="other traffic: this workload's programs, spread among the first's (which keep "
        "their arrival rate), ask for no holds (timed apart: other e2e)",
    )
    p.add_argument("--mix-size", default="smoke", choices=["full", "smoke"])
    p.add_argument("--mix-scale", type=float, default=1.0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="programs per second")
    p.add_argument(
        "--step-s", type=float, default=0.0, help="virtual seconds per step (0: wall time)"
    )
    p.add_argument("--token-s", type=float, default=0.0, help="with --step-s: virtual seconds "
                   "per computed token, added to each step")  # fmt: skip
    args = p.parse_args()
    extra = {"tool_pause_s": args.tool_pause_s} if args.tool_pause_s else {}
    # vocab of the tiny tokenizer: the ids only have to be valid, their values do not matter
    wl = make_workload(args.workload, size=args.size, scale=args.scale, vocab_size=2048, **extra)
    working_set = math.ceil(wl.working_set_tokens() / args.block_size)  # the first's alone
    holds = None
    if args.mix:
        other = make_workload(args.mix, size=args.mix_size, scale=args.mix_scale, vocab_size=2048,
                              seed=1)  # fmt: skip
        first = len(wl.programs)
        wl, holds = interleave(wl, other)
        args.request_rate *= len(wl.programs) / first  # the first's programs keep their rate
    if args.kv_ratio is not None:
        args.num_kv_blocks = math.ceil(working_set / args.kv_ratio)
    ratio = working_set / args.num_kv_blocks
    print(f"{args.workload} ({args.size}, scale {args.scale}), {args.num_kv_blocks} blocks "
          f"(working set {working_set} blocks: kv/{ratio:.2f})")  # fmt: skip
    share = {}
    if args.retention_max_share is not None:
        share["retention_max_share"] = args.retention_max_share
    print(f"{'config':>16} {'steps':>6} {'computed':>9} {'preempt':>7} {'evicted':>7} {'hit':>6}")
    for config in args.configs.split(","):
        for ttl in map(float, args.cache_ttl_s.split(",")):
            cache, policy = config.split("+")
            r = simulate(
                wl,
                cache,
                policy,
                args.num_kv_blocks,
                args.block_size,
                args.num_host_kv_blocks,
                ttl,
                args.request_rate,
                args.step_s,
                args.token_s,
                holds,
                **share,
            )
            print(
                f"{config:>16} ttl {ttl:g} recomputed {r['recomputed']:>8} "
                f"{r['steps']:>6} {r['computed_tokens']:>9} {r['preemptions']:>7} "
                f"{r['evicted_blocks']:>7} {r['hit_rate']:>6.3f} host {r['host_hit_tokens']:>8} "
                f"loaded {r['loaded_blocks']:>7} written back {r['written_back_blocks']:>7} "
                f"duration {r['duration_s']:7.2f} s e2e mean {r['e2e_mean_s']:6.3f} s "
                f"p50 {r['e2e_p50_s']:6.3f} s ({r['wall_s']:.1f} s wall)"
                + (
                    f" other: e2e mean {r['other_e2e_mean_s']:6.3f} s p90 "
                    f"{r['other_e2e_p90_s']:6.3f} s computed {r['other_computed']}"
                    if holds
                    else ""
                )  # fmt: skip
            )


if __name__ == "__main__":
    main()
