"""Multi-call programs measured as programs: the suite of `benchmarks/programs` under the DSL
on radixrt, its ablations, and the same programs written with the OpenAI client.

| config | what runs |
|---|---|
| radix | DSL, in-process engine, radix tree + longest-prefix-match scheduling |
| blockhash | no tree: block-hash prefix cache (vLLM APC semantics), FCFS |
| no-cache | no prefix cache, FCFS |
| fcfs, random | radix tree, first-come-first-served / random admission order |
| no-parallel | DSL without frontend parallelism: a program's forks run one after another |
| no-hints | DSL without frontend hints: no prefix sent ahead (forks, select, batches) |
| no-admission | DSL without run_batch's program admission under cache pressure |
| dsl-http | DSL through `RuntimeEndpoint` on a `radixrt serve` (radix + lpm) |
| openai-seq | OpenAI client, a program's calls in a plain sequential loop, same server |
| openai-async | asyncio OpenAI client, a program's branches gathered, same server |

Each program runs `num_programs` times concurrently (programs/s, cache counters) and then a
few more one at a time (latency per program). The optimal hit rate of a run replays the
requests it sent through a perfect infinite cache (`programs/accounting.py`). A dry run
without a model gives every program's calls and working set first: `--kv-fraction F` sizes
the KV pool to F x the largest working set (all configs share the pool).

    python -m benchmarks.bench_programs --size smoke                      # CPU, tiny model
    python -m benchmarks.bench_programs --model llama-3-8b --kv-fraction 0.4   # GPU, dummy

`--runner scripted` simulates the in-process configs on a CPU: the real scheduler, caches and
DSL, no model (a scripted runner emits the forced tokens, `--sim-step-s` per step plus
`--sim-token-s` per token a step feeds; the json
program, which needs a model's grammar, is left out): the GPU run's cache behaviour, hit
rates and computed tokens, at full size in minutes.

    python -m benchmarks.bench_programs --runner scripted --model llama-3-8b --size full \
        --scale 0.5 --kv-fraction 0.4 --configs radix,blockhash,no-hints
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import tempfile
import time

from benchmarks.backends import engine_options
from benchmarks.metrics import save_results, targets_markdown
from benchmarks.programs import PROGRAMS, Words
from benchmarks.programs.accounting import Call, CallLog, replay
from benchmarks.programs.dsl_clients import Dry, Recording, run_dsl
from benchmarks.programs.report import check_targets, format_table, median_rows, plot_rows
from benchmarks.programs.runner import CONFIGS, Config, Plan, run_config
from benchmarks.stack_sampler import StackSampler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir, or a preset of "
                   "radixrt.model.presets (dummy weights); default: the tiny model")  # fmt: skip
    p.add_argument("--size", default="full", choices=["full", "smoke"])
    p.add_argument("--programs", default=",".join(PROGRAMS), help="comma list")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list")
    p.add_argument("--scale", type=float, default=1.0, help="x num_programs of every program")
    p.add_argument("--latency-programs", type=int, default=3, help="programs run one at a "
                   "time for the latency")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=64, help="programs in flight")
    p.add_argument("--kv-fraction", type=float, default=None, help="KV pool = this x the "
                   "largest program working set (default: the engine's pool)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="runs of each program per config; "
                   "tables and targets use the median run, with the spread of all")  # fmt: skip
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--tag", default="programs")
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="overrides --kv-fraction")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--aging-tokens-per-step", type=float, default=None)
    g.add_argument("--retention-max-share", type=float, default=None, help="share of the pool "
                   "retention holds (a program's context between its calls) may keep; default: "
                   "the engine's")  # fmt: skip
    g.add_argument("--disable-cuda-graph", action="store_true")
    g.add_argument("--disable-overlap-schedule", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--server-startup-timeout-s", type=float, default=900.0)
    g.add_argument(
        "--runner",
        default="model",
        choices=["model", "scripted"],
        help="scripted: no model, the in-process configs simulated on a CPU",
    )
    g.add_argument("--sim-step-s", type=float, default=0.02, help="--runner scripted: seconds "
                   "per engine step (the stand-in for a forward)")  # fmt: skip
    g.add_argument("--sim-token-s", type=float, default=0.0, help="--runner scripted: "
                   "seconds per token a step feeds, on top (H200, 8B: ~2.3e-5)")  # fmt: skip
    p.add_argument("--sample-stacks", default=None, metavar="PATH", help="sample every "
                   "thread's stack during the concurrent runs into PATH (JSON; read it with "
                   "python -m benchmarks.stack_sampler PATH --phase CONFIG/PROGRAM)")  # fmt: skip
    g.add_argument("--config-timeout-s", type=float, default=None, help="start no program on "
                   "an engine (or server) once it ran this long; in-process configs of the same "
                   "cache and order share one engine and this time (rows finished are "
                   "kept)")  # fmt: skip
    return p.parse_args(argv)


def resolve_model(args: argparse.Namespace) -> str:
    """The model dir; a preset name writes a dummy-weight dir (and sets --load-format)."""
    from radixrt.model.presets import PRESETS, write_dummy_model_dir
    from radixrt.model.tiny import ensure_tiny_model

    if args.model is None:
        return ensure_tiny_model()
    if args.model in PRESETS and not os.path.isdir(args.model):
        args.load_format = "dummy"
        return write_dummy_model_dir(tempfile.mkdtemp(prefix="bench-programs-"), args.model)
    return args.model


def plan_programs(args: argparse.Namespace, tokenizer, max_len: int) -> list[Plan]:
    words = Words(tokenizer)
    plans = []
    for name in [n for n in args.programs.split(",") if n]:
        if name not in PROGRAMS:
            raise ValueError(f"unknown program {name!r}; known: {', '.join(PROGRAMS)}")
        spec = PROGRAMS[name]
        n = max(1, round(spec.sizes[args.size]["num_programs"] * args.scale))
        inputs = spec.inputs(words, args.size, args.seed, 0, n)
        latency = spec.inputs(words, args.size, args.seed, n, args.latency_programs)
        warmup = spec.inputs(words, args.size, args.seed + 1, 0, 1)
        log = CallLog()
        run_dsl(spec, inputs, Recording(Dry(tokenizer, words.ids[0]), log), threads=1)
        calls = log.calls
        context = max(len(c.prompt_ids) + c.max_tokens for c in calls)
        if context > max_len:
            raise ValueError(f"{name} needs {context} tokens of context, the model allows "
                             f"{max_len}; use --size smoke or a longer-context model")  # fmt: skip
        plans.append(
            Plan(spec, inputs, latency, warmup, calls, replay(calls).unique_tokens, context)
        )
    return plans


def kv_blocks(args: argparse.Namespace, plans: list[Plan]) -> int | None:
    if args.num_kv_blocks is not None or args.kv_fraction is None:
        return args.num_kv_blocks
    bs = args.block_size
    largest = max(p.working_set_tokens for p in plans)
    floor = 2 * max(math.ceil(p.max_context / bs) for p in plans)
    return max(math.ceil(args.kv_fraction * largest / bs), floor)


def targets_of(cfgs: list[Config]) -> list[tuple[tuple, list[Config]]]:
    """(target key, configs) in config order: one in-process engine per (cache, policy),
    one fresh server per server config (nothing cached from another client's run)."""
    groups: dict[tuple, list[Config]] = {}
    for c in cfgs:
        key = ("server", c.name) if c.on_server else ("engine", c.cache, c.policy)
        groups.setdefault(key, []).append(c)
    return list(groups.items())


def run_suite(args: argparse.Namespace, command: str) -> dict:
    from radixrt.config import ModelConfig
    from radixrt.hf_dir import load_tokenizer

    model = args.resolved_model = resolve_model(args)
    args.tokenizer = load_tokenizer(model)
    mc = ModelConfig.from_pretrained(model)
    plans = plan_programs(args, args.tokenizer, mc.max_position_embeddings)
    cfgs = []
    for name in [n for n in args.configs.split(",") if n]:
        if name not in CONFIGS:
            raise ValueError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
        if args.runner == "scripted" and CONFIGS[name].on_server:
            raise ValueError(f"--runner scripted simulates the in-process configs, not {name!r}")
        cfgs.append(CONFIGS[name])
    if args.repeat < 1 or (args.repeat > 1 and any(c.on_server for c in cfgs)):
        raise ValueError("--repeat: >= 1, and 1 with server configs (a server keeps the "
                         "prefixes of earlier runs)")  # fmt: skip
    if any(c.client.startswith("openai") for c in cfgs):
        import openai  # noqa: F401  (the openai configs need it: pip install openai)
    kv = kv_blocks(args, plans)
    if args.runner == "scripted":  # the pool is sized as for the model run, with them
        from benchmarks.programs.scripted import NEEDS_MODEL

        plans = [p for p in plans if p.spec.name not in NEEDS_MODEL]
    os.makedirs(args.out, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k not in ("tokenizer", "stack_sampler")}
    results = {"command": command, "args": meta, "kv_blocks": kv, "rows": [], "targets": [],
               "programs": {p.spec.name: {"shape": p.spec.shape, "num_programs": len(p.inputs),
                                          "working_set_tokens": p.working_set_tokens,
                                          "calls": sum(c.kind != "hint" for c in p.reference)}
                            for p in plans}}  # fmt: skip
    print(
        f"KV pool: {kv or 'engine default'} blocks; working sets (tokens): "
        + ", ".join(f"{p.spec.name} {p.working_set_tokens}" for p in plans),
        flush=True,
    )
    for key, group in targets_of(cfgs):
        opts = engine_options(args, group[0].cache, group[0].policy, kv)
        with _Target(key, model, opts, args) as target:
            history: list[Call] = []
            started = time.perf_counter()
            for plan in plans:
                if (
                    args.config_timeout_s is not None
                    and time.perf_counter() - started > args.config_timeout_s
                ):
                    print(f"{key}: --config-timeout-s reached, skipping {plan.spec.name} and "
                          "the programs after it", flush=True)  # fmt: skip
                    break
                for _ in range(args.repeat):
                    for cfg in group:
                        row = run_config(cfg, plan, target, args, history)
                        results["rows"].append(row)
                        print(_one_line(row), flush=True)
                        _write(results, args, plans)
    return results


def warmup_prompts(max_len: int, num: int = 48) -> list[list[int]]:
    """An engine's first batch, before any timed run: `num` prompts of lengths spread up to
    half the context, half of them behind one shared prefix, so the first config's first
    program does not pay what any later one finds done (kernels compiled for batch and row
    shapes, copy-on-write of a partly cached block, mixed prefill and decode steps)."""
    longest = max(8, min(max_len // 2, 1024))
    shared = [11 + i % 97 for i in range(longest // 2)]
    prompts = []
    for i in range(num):
        n = 4 + (i * 37) % (longest - 4)
        own = [200 + (i * 13 + j) % 500 for j in range(n)]
        prompts.append((shared + own)[:longest] if i % 2 else own)
    return prompts


class _Target:
    """An in-process Engine (warmed up) or a fresh `radixrt serve` (its URL)."""

    def __init__(self, key: tuple, model: str, opts: dict, args: argparse.Namespace) -> None:
        self.key, self.model, self.opts, self.args = key, model, opts, args

    def __enter__(self):
        from radixrt.sampling import SamplingParams

        if self.key[0] == "engine":
            from radixrt.engine import Engine

            if self.args.runner == "scripted":
                from benchmarks.programs.scripted import scripted_engine

                filler = Words(self.args.tokenizer).ids[0]  # what the dry run emits
                opts = {k: v for k, v in self.opts.items() if k not in ("device", "load_format")}
                opts["overlap_schedule"] = True  # as on CUDA
                self.engine = scripted_engine(
                    self.model, filler, self.args.sim_step_s, self.args.sim_token_s, **opts
                )
            else:
                self.engine = Engine(self.model, **self.opts)
            self.engine.generate(
                prompt_token_ids=warmup_prompts(self.engine.max_model_len),
                sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
            )
            self.engine.cache.reset()
            return self.engine
        from benchmarks.http_driver import ServerProcess

        serve = []
        for k, v in self.opts.items():
            if k in ("enable_cuda_graph", "overlap_schedule"):  # only ever set to False
                serve.append("--disable-" + k.removeprefix("enable_").replace("_", "-"))
            elif v is not None:
                serve += ["--" + k.replace("_", "-"), str(v)]
        log = os.path.join(self.args.out, f"{self.args.tag}-server.log")
        self.server = ServerProcess(self.model, serve, log, self.args.server_startup_timeout_s)
        return self.server.__enter__().url

    def __exit__(self, *exc: object) -> None:
        if self.key[0] == "engine":
            self.engine.shutdown()
        else:
            self.server.__exit__(*exc)


def _one_line(r: dict) -> str:
    lat = "n/a" if r["latency_s"] is None else f"{r['latency_s']:.3f} s"
    return (
        f"{r['program']:>20} {r['config']:>12}: {r['programs_per_s']:7.2f} programs/s, "
        f"latency {lat}, hit {100 * r['hit_rate']:5.1f}% (optimal "
        f"{100 * r['optimal_hit_rate']:5.1f}%), computed {r['prompt_tokens_computed']}, "
        f"same calls {r['same_calls']}" + (f", {r['steps']} steps" if r.get("steps") else "")
    )


def _write(results: dict, args: argparse.Namespace, plans: list[Plan]) -> None:
    results["medians"] = median_rows(results["rows"])
    if args.size == "full":
        fork_heavy = {p.spec.name for p in plans if p.spec.fork_heavy}
        results["targets"] = check_targets(results["medians"], fork_heavy)
    targets = targets_markdown(results["targets"])
    markdown = f"`{results['command']}`\n\n" + format_table(results["medians"]) + "\n"
    base = save_results(args.out, args.tag, results, markdown + ("\n" + targets if targets else ""))
    plot_rows(results["medians"], base + ".png", f"{args.tag}: {args.size}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # servers started from here
    command = shlex.join(["python", "-m", "benchmarks.bench_programs", *argv])
    args.stack_sampler = StackSampler() if args.sample_stacks else None
    try:
        results = run_suite(args, command)
    finally:
        if args.stack_sampler is not None:
            args.stack_sampler.close()
            args.stack_sampler.save(args.sample_stacks)
    print("\n" + format_table(results["medians"]) + "\n")
    for t in results["targets"]:
        print(f"{t['status']:>4}  {t['text']}")
    print(f"wrote {os.path.join(args.out, args.tag)}.{{json,md,png}}")


if __name__ == "__main__":
    main()
