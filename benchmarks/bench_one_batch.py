"""One static batch on a dummy Llama-3-8B (bf16, random weights), one GPU, next to its floor.

Drives ModelRunner directly with step plans (no scheduler, no tokenizer):
- decode: B = 1, 32, 256 rows (`--batches`), each with CONTEXT cached tokens (KV filled with random
  values), feeding token CONTEXT + 1 every step (the batch does not grow, so every step is
  the same). Full step = `runner.execute(plan).result()` (host-side metadata, graph replay or
  eager forward, lm_head, greedy sampling, the host round trip); CUDA graph vs eager; plus the
  GPU time of the graph replay alone.
- `--engine-core`: B requests through EngineCore (scheduler + runner), pure-decode steps,
  overlap off and on, next to the graph replay time at the same batch (same run); wall ms
  per step and per generated token per row. `--cases` picks the workloads: `plain` (greedy),
  `presence_penalty` (presence_penalty 0.5 on every row), `ngram` (an ngram-speculating
  engine on the random prompts: rows rarely draft), `ngram_repeat` (the same engine on a
  64-token pattern repeated: drafts are accepted; tokens per step and acceptance reported).
Decode floor = (weights read + KV read) / COPY_BW.
- prefill: 1 x 4096 and 32 x 1024 tokens from scratch, one forward each (eager). Floor =
  FLOPs / BF16_FLOPS (linear layers + causal attention + lm_head on the sampled rows).
- `--fused-ops triton,flashinfer,triton-rope`: everything above once per layer-ops choice
  (`RADIXRT_FUSED_OPS`, radixrt.model.layer_ops: "triton" fuses RoPE + KV store and runs the
  Triton norms and SiLU-and-mul, "flashinfer" FlashInfer's kernels and a separate store,
  "triton-rope" FlashInfer's norms and SiLU-and-mul with the fused RoPE + KV store), one
  runner or engine after the other in the same process; default: triton alone.
Timing: CUDA events around each step after warm-up; medians. Prints a table last.

    python -m benchmarks.bench_one_batch [--engine-core] [--json out.json]
        [--profile kernels.txt] [--quantization fp8 [--fp8-activation-scale token|tensor]]
        [--kv-cache-dtype fp8_e4m3] [--fused-ops triton,flashinfer]
        [--cases plain,presence_penalty,ngram,ngram_repeat] [--batches 1,32,256,512]

B = 512 at CONTEXT 1024 holds 68 GB of bf16 KV (half with fp8): past an 80 GB H100 with bf16
KV and bf16 weights.

`--quantization fp8`: the dummy weights are quantized at load (W8A8 fp8 linears; lm_head and
embeddings stay bf16); floors still assume bf16 FLOP/s for prefill.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from radixrt.config import ModelConfig, resolve_config
from radixrt.engine.core import EngineCore
from radixrt.executor.runner import ModelRunner
from radixrt.model.layer_ops import FUSED_OPS, FUSED_OPS_ENV
from radixrt.model.presets import write_dummy_model_dir
from radixrt.plan import PlanRow, StepPlan
from radixrt.sampling import SamplingParams

COPY_BW = 4.27e12  # B/s, device-to-device copy measured on this H200 (read + write)
BF16_FLOPS = 790e12  # FLOP/s, large bf16 GEMM measured on this H200
PRESET = "llama-3-8b"
CONTEXT = 1024
DECODE_BATCHES = (1, 32, 256)
PREFILLS = ((1, 4096), (32, 1024))  # (rows, tokens per row)
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
GREEDY = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)


def make_plan(
    runner: ModelRunner, rows: list[tuple[int, int]], rng: np.random.Generator
) -> StepPlan:
    """A StepPlan of rows (num_cached, num_new), decode rows (1 new token on a cached
    context) first, slot i for row i, with consecutive blocks from block 0 (plans may share
    blocks: only one runs at a time and KV values do not matter here)."""
    from radixrt.plan import SlotEntry  # (here: --engine-core runs against older trees too)

    vocab = runner.model_cfg.vocab_size
    plan_rows, next_block = [], 0
    for i, (cached, new) in enumerate(rows):
        total = cached + new
        num_blocks = math.ceil(total / BLOCK_SIZE)
        assert next_block + num_blocks <= runner.num_usable_blocks, "pool too small for the plan"
        plan_rows.append(
            PlanRow(
                rid=f"r{i}",
                slot=i,
                start=cached,
                num_tokens=new,
                input_ids=rng.integers(0, vocab, new).tolist(),
                new_blocks=list(range(next_block, next_block + num_blocks)),
                sample_offsets=[new - 1],
            )
        )
        next_block += num_blocks
    runner.enter_slots([SlotEntry(i, 1, GREEDY) for i in range(len(rows))])
    return StepPlan(0, plan_rows)


def run_step(runner: ModelRunner, plan: StepPlan, use_cuda_graph: bool = True) -> None:
    """One runner step with its host round trip (what a non-overlapped loop waits for)."""
    runner.execute(plan, use_cuda_graph=use_cuda_graph).result()


CASES = ("plain", "presence_penalty", "ngram", "ngram_repeat")
NGRAM_K = 4  # drafts per verify row in the ngram cases


def case_max_tokens(case: str, steps: int) -> int:
    """Enough that no row finishes within the timed steps (verify rows: k + 1 a step)."""
    return (NGRAM_K + 1 if case.startswith("ngram") else 1) * steps + 64


def case_params(case: str, steps: int) -> SamplingParams:
    extra = {"presence_penalty": 0.5} if case == "presence_penalty" else {}
    max_tokens = case_max_tokens(case, steps)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def case_prompt(case: str, vocab: int, rng: np.random.Generator) -> list[int]:
    if case == "ngram_repeat":  # a 64-token pattern, repeated: ngram drafts find it
        pattern = rng.integers(0, vocab, 64).tolist()
        return (pattern * (CONTEXT // 64 + 1))[:CONTEXT]
    return rng.integers(0, vocab, CONTEXT).tolist()


def engine_core_decode(
    core: EngineCore,
    batch: int,
    steps: int,
    overlap: bool,
    rng: np.random.Generator,
    case: str = "plain",
) -> dict:
    """B requests of CONTEXT prompt tokens through an idle EngineCore (scheduler + runner):
    after their prefill, the median host wall time of a decode `core.step()` and the wall ms
    per generated token per row (all timed steps / their tokens per row)."""
    core.overlap = overlap
    vocab = core.model_config.vocab_size
    params = case_params(case, steps)
    for _ in range(batch):
        core.add_request(case_prompt(case, vocab, rng), params)
    while any(r.num_output < 2 for r in core.scheduler.requests.values()):
        core.step()
    torch.cuda.synchronize()
    generated = core.stats()["generated_tokens"]
    spec = core.stats()
    times = []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    after = core.stats()
    tokens = after["generated_tokens"] - generated
    graphs = core.runner.cuda_graphs
    gpu_ms = time_ms(graphs.graphs[graphs.bucket(batch)].replay, warmup=3, iters=20)
    for rid in list(core.scheduler.requests):
        core.abort(rid)
    while core.has_work:
        core.step()
    core.check_integrity()
    ms = statistics.median(times[5:])
    drafts = after["spec_draft_tokens"] - spec["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - spec["spec_accepted_tokens"]
    verify_rows = after["spec_verify_rows"] - spec["spec_verify_rows"]
    skipped = after.get("spec_proposals_skipped", 0) - spec.get("spec_proposals_skipped", 0)
    return dict(
        case=case,
        batch=batch,
        overlap=overlap,
        ms_per_step=ms,
        ms_per_token_per_row=wall_ms / (tokens / batch),
        tokens_per_step=tokens / steps,
        output_tok_s=tokens / wall_ms * 1e3,
        spec_acceptance=accepted / drafts if drafts else 0.0,
        verify_rows_per_step=verify_rows / steps,
        skipped_proposals_per_step=skipped / steps,
        graph_gpu_ms=gpu_ms,
        over=ms / gpu_ms - 1,
    )


def engine_core_cases(cfg, model_cfg, cases, batches, steps, rng) -> list[dict]:
    """`engine_core_decode` for each case (ngram cases on an ngram-speculating engine),
    batch and overlap setting; one engine at a time."""
    rows = []
    for spec in (False, True):
        todo = [c for c in cases if c.startswith("ngram") == spec]
        if not todo:
            continue
        c = cfg
        if spec:
            c = dataclasses.replace(
                cfg,
                speculative=dataclasses.replace(
                    cfg.speculative, speculative_method="ngram", ngram_min_n=2, ngram_max_n=4
                ),
                scheduler=dataclasses.replace(cfg.scheduler, num_speculative_tokens=NGRAM_K),
            )
        core = EngineCore(c, model_cfg, [])
        for case in todo:
            for bsz in batches:
                for overlap in (False, True):
                    row = engine_core_decode(core, bsz, steps, overlap, rng, case)
                    rows.append(row)
                    print(f"engine_core {row}")
        core.shutdown()
        del core
        torch.cuda.empty_cache()
    return rows


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of fn() between two CUDA events (host work included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_category(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk")):
        return "gemm"
    if any(s in n for s in ("prefill", "decode", "mergestate", "merge_state", "attention")):
        return "attention"
    if "norm" in n:
        return "rmsnorm"
    if "rope_store_kv" in n:
        return "rope_store_kv"
    if "rotary" in n or "rope" in n:
        return "rope"
    if "act_and_mul" in n or "silu" in n:
        return "silu_mul"
    if "store_kv" in n:
        return "store_kv"
    return "other"


def profile(fn, steps: int, path: str, title: str) -> dict[str, float]:
    """Device ms per step by kernel category; the kernel table is appended to `path`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    with open(path, "a") as f:
        f.write(f"\n===== {title} ({steps} steps) =====\n")
        f.write(events.table(sort_by="self_device_time_total", row_limit=30))
    cats: dict[str, float] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        cat = kernel_category(e.key)
        cats[cat] = cats.get(cat, 0.0) + e.self_device_time_total / 1e3 / steps
    return dict(sorted(cats.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--profile", help="profile each case; append kernel tables to this file")
    ap.add_argument("--iters", type=int, default=30, help="timed decode steps per case")
    ap.add_argument(
        "--engine-core",
        action="store_true",
        help="also time decode steps end to end through EngineCore, overlap off and on",
    )
    ap.add_argument(
        "--load-format",
        default="dummy",
        choices=["dummy"],
        help="always dummy (random weights); accepted for the common command line",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="fp8: W8A8 fp8 linears, the dummy weights quantized at load",
    )
    ap.add_argument("--fp8-activation-scale", default="auto", choices=["auto", "token", "tensor"])
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3"],
        help="fp8_e4m3: an fp8 KV pool (its decode rows on XQA on Hopper)",
    )
    ap.add_argument(
        "--cases",
        default="plain",
        help=f"--engine-core workloads, comma-separated from {','.join(CASES)}",
    )
    ap.add_argument(
        "--batches",
        default=",".join(map(str, DECODE_BATCHES)),
        help="decode batch sizes, comma-separated (up to 1024: the largest CUDA graph)",
    )
    ap.add_argument(
        "--fused-ops",
        default=FUSED_OPS[0],
        help=f"layer ops to measure one after the other, comma-separated from {FUSED_OPS} "
        f"(sets {FUSED_OPS_ENV})",
    )
    args = ap.parse_args()
    cases = args.cases.split(",")
    bad = sorted(set(cases) - set(CASES))
    if bad:
        raise SystemExit(f"unknown --cases {bad}: pick from {CASES}")
    ops_choices = args.fused_ops.split(",")
    bad = sorted(set(ops_choices) - set(FUSED_OPS))
    if bad:
        raise SystemExit(f"unknown --fused-ops {bad}: pick from {FUSED_OPS}")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(
            f"--batches must be comma-separated integers, got {args.batches!r}"
        ) from None
    if not all(1 <= b <= 1024 for b in batches):
        raise SystemExit(f"--batches must lie in 1..1024, got {batches}")
    torch.manual_seed(0)
    rng = np.random.default_rng(0)

    model_dir = write_dummy_model_dir(os.path.join(tempfile.mkdtemp(), PRESET), PRESET)
    model_cfg = ModelConfig.from_pretrained(model_dir)
    blocks_needed = max(
        max(batches) * math.ceil((CONTEXT + 1) / BLOCK_SIZE),
        max(rows * math.ceil(n / BLOCK_SIZE) for rows, n in PREFILLS),
    )
    cfg = resolve_config(
        model_dir,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        attention_backend="flashinfer",
        enable_cuda_graph=True,
        num_kv_blocks=blocks_needed + 1,  # + the CUDA-graph scratch block
        block_size=BLOCK_SIZE,
        max_running_requests=max(batches),
        max_model_len=MAX_MODEL_LEN,
        # (only when set: a tree from before FP8 weights runs this script too)
        **(
            dict(quantization="fp8", fp8_activation_scale=args.fp8_activation_scale)
            if args.quantization
            else {}
        ),
        **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype != "auto" else {}),
    )
    label = "bf16 weights"  # for the tables' titles
    if args.quantization:
        label = f"{args.quantization} weights, activation scale {args.fp8_activation_scale}"
    label += f", {'bf16' if args.kv_cache_dtype == 'auto' else args.kv_cache_dtype} KV"
    results: dict[str, list[dict]] = {"decode": [], "prefill": [], "profile": [], "engine_core": []}
    results["quantization"] = [{"quantization": args.quantization,
                                "fp8_activation_scale": args.fp8_activation_scale}]  # fmt: skip
    if args.engine_core:
        steps = args.iters * 2
        most = max(case_max_tokens(c, steps) for c in cases)
        per_row = math.ceil((CONTEXT + most + NGRAM_K + 8) / BLOCK_SIZE)
        cfg = dataclasses.replace(
            cfg,
            cache=dataclasses.replace(cfg.cache, num_kv_blocks=max(batches) * per_row + 1),
        )
        for ops in ops_choices:
            os.environ[FUSED_OPS_ENV] = ops  # read when the engine builds its model
            for row in engine_core_cases(cfg, model_cfg, cases, batches, steps, rng):
                results["engine_core"].append(dict(row, fused_ops=ops))
        print(f"\n## EngineCore decode (H200, dummy {PRESET}, {label}, block size {BLOCK_SIZE})")
        print(
            "| ops | case | B | ctx | overlap | ms/step | ms/token/row | tokens/step | tok/s "
            "| acceptance | graph GPU ms | over replay |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results["engine_core"]:
            print(
                f"| {r['fused_ops']} | {r['case']} | {r['batch']} | {CONTEXT} "
                f"| {'on' if r['overlap'] else 'off'} "
                f"| {r['ms_per_step']:.2f} | {r['ms_per_token_per_row']:.2f} "
                f"| {r['tokens_per_step']:.1f} | {r['output_tok_s']:.0f} "
                f"| {r['spec_acceptance']:.2f} | {r['graph_gpu_ms']:.2f} | {r['over']:+.1%} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return

    build_s, weight_bytes = {}, 0
    for ops in ops_choices:
        os.environ[FUSED_OPS_ENV] = ops  # read when the runner builds its model
        start = time.perf_counter()
        runner = ModelRunner(cfg, model_cfg, MAX_MODEL_LEN, cfg.scheduler.max_running_requests)
        torch.cuda.synchronize()
        build_s[ops] = time.perf_counter() - start
        for layer_kv in runner.pool.kv:  # random KV: never time on zeros (fp8: drawn in bf16)
            layer_kv.copy_(torch.empty_like(layer_kv, dtype=torch.bfloat16).uniform_(-1.0, 1.0))
        weight_bytes = sum(
            p.numel() * p.element_size()
            for name, p in runner.model.named_parameters()
            if "embed_tokens" not in name  # only the rows of the step's tokens are read
        )
        linear_params = sum(
            p.numel()
            for name, p in runner.model.layers.named_parameters()
            if name.endswith("proj.weight")
        )
        m = model_cfg
        kv_element = 1 if args.kv_cache_dtype == "fp8_e4m3" else 2
        kv_bytes_per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * kv_element
        print(
            f"{PRESET} ({args.quantization or 'bf16'} linears): weights read per step "
            f"{weight_bytes / 1e9:.2f} GB, KV {kv_bytes_per_token} "
            f"B/token; runner built in {build_s[ops]:.1f} s (dummy weights, KV pool, CUDA graphs)"
        )

        for bsz in batches:
            plan = make_plan(runner, [(CONTEXT, 1)] * bsz, rng)
            kv_bytes = bsz * (CONTEXT + 1) * kv_bytes_per_token
            floor_ms = (weight_bytes + kv_bytes) / COPY_BW * 1e3
            for graph in (True, False):
                step = functools.partial(run_step, runner, plan, use_cuda_graph=graph)
                ms = time_ms(step, warmup=5, iters=args.iters)
                gpu_ms = None
                if graph:
                    replay = runner.cuda_graphs.graphs[runner.cuda_graphs.bucket(bsz)].replay
                    gpu_ms = time_ms(replay, warmup=3, iters=args.iters)
                row = dict(
                    batch=bsz,
                    context=CONTEXT,
                    cuda_graph=graph,
                    ms_per_step=ms,
                    tok_per_s=bsz / ms * 1e3,
                    graph_gpu_ms=gpu_ms,
                    floor_ms=floor_ms,
                    floor_tok_per_s=bsz / floor_ms * 1e3,
                    fraction_of_floor=floor_ms / ms,
                )
                results["decode"].append(dict(row, fused_ops=ops))
                print(f"decode {row}")
            if args.profile:
                for graph in (True, False):
                    case = f"decode B={bsz} graph={graph} ops={ops}"
                    step = functools.partial(run_step, runner, plan, use_cuda_graph=graph)
                    cats = profile(step, 5, args.profile, case)
                    results["profile"].append(dict(case=case, ms=cats))
                    print(f"profile {case}: {cats}")

        for num_rows, length in PREFILLS:
            plan = make_plan(runner, [(0, length)] * num_rows, rng)
            tokens = num_rows * length
            flops = (
                2 * tokens * linear_params
                + 2 * num_rows * m.hidden_size * m.vocab_size
                + 4 * m.num_layers * m.num_heads * m.head_dim * num_rows * length * (length + 1) / 2
            )
            step = functools.partial(run_step, runner, plan)
            iters = max(3, min(10, int(2e5 // tokens)))
            ms = time_ms(step, warmup=1, iters=iters)
            floor_ms = flops / BF16_FLOPS * 1e3
            row = dict(
                rows=num_rows,
                tokens_per_row=length,
                ms=ms,
                tok_per_s=tokens / ms * 1e3,
                tflop_per_s=flops / ms / 1e9,
                floor_ms=floor_ms,
                fraction_of_floor=floor_ms / ms,
            )
            results["prefill"].append(dict(row, fused_ops=ops))
            print(f"prefill {row}")
            if args.profile:
                case = f"prefill {num_rows}x{length} ops={ops}"
                cats = profile(step, 1, args.profile, case)
                results["profile"].append(dict(case=case, ms=cats))
                print(f"profile {case}: {cats}")
        runner.close()
        del runner, plan, step, replay
        gc.collect()  # the next runner needs the device memory (cycles hold the graphs)
        torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(build_s=build_s, weight_bytes=weight_bytes, **results), f, indent=2)
    print(f"\n## One batch (H200, dummy {PRESET}, {label}, block size {BLOCK_SIZE})")
    print(
        "| decode | ops | B | ctx | graph | ms/step | tok/s | graph GPU ms | floor ms | of floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["decode"]:
        gpu = f"{r['graph_gpu_ms']:.2f}" if r["graph_gpu_ms"] is not None else "-"
        print(
            f"| decode | {r['fused_ops']} | {r['batch']} | {r['context']} "
            f"| {'yes' if r['cuda_graph'] else 'no'} "
            f"| {r['ms_per_step']:.2f} | {r['tok_per_s']:.0f} | {gpu} | {r['floor_ms']:.2f} "
            f"| {r['fraction_of_floor']:.0%} |"
        )
    print("| prefill | ops | rows x len | | ms | tok/s | TFLOP/s | floor ms | of floor |")
    for r in results["prefill"]:
        print(
            f"| prefill | {r['fused_ops']} | {r['rows']}x{r['tokens_per_row']} | | {r['ms']:.1f} "
            f"| {r['tok_per_s']:.0f} | {r['tflop_per_s']:.0f} | {r['floor_ms']:.1f} "
            f"| {r['fraction_of_floor']:.0%} |"
        )


if __name__ == "__main__":
    main()
