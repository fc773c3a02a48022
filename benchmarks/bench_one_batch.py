"""One static batch on a dummy Llama-3-8B (bf16, random weights), one GPU, next to its floor.

Drives ModelRunner directly with token ids (no scheduler, no tokenizer):
- decode: B = 1, 32, 256 rows, each with CONTEXT cached tokens (KV filled with random
  values), feeding token CONTEXT + 1 every step (the batch does not grow, so every step is
  the same). Full step = `runner.forward` (host-side metadata, graph replay or eager
  forward, lm_head, greedy sampling, the host sync); CUDA graph vs eager; plus the GPU time
  of the graph replay alone. Floor = (weights read + KV read) / COPY_BW.
- prefill: 1 x 4096 and 32 x 1024 tokens from scratch, one forward each (eager). Floor =
  FLOPs / BF16_FLOPS (linear layers + causal attention + lm_head on the sampled rows).
Timing: CUDA events around each step after warm-up; medians. Prints a table last.

    PYTHONPATH=. python benchmarks/bench_one_batch.py [--json out.json] [--profile kernels.txt]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from radixrt.config import ModelConfig, resolve_config
from radixrt.engine.runner import ModelRunner
from radixrt.model.presets import write_dummy_model_dir
from radixrt.sampling import SamplingParams
from radixrt.scheduler.batch import BlockTableArray, ScheduledBatch
from radixrt.scheduler.request import Request

COPY_BW = 4.27e12  # B/s, device-to-device copy measured on this H200 (read + write)
BF16_FLOPS = 790e12  # FLOP/s, large bf16 GEMM measured on this H200
PRESET = "llama-3-8b"
CONTEXT = 1024
DECODE_BATCHES = (1, 32, 256)
PREFILLS = ((1, 4096), (32, 1024))  # (rows, tokens per row)
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
GREEDY = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)


def make_batch(
    runner: ModelRunner, rows: list[tuple[int, int]], rng: np.random.Generator
) -> tuple[ScheduledBatch, BlockTableArray]:
    """A ScheduledBatch of rows (num_cached, num_new), decode rows (1 new token on a cached
    context) first, with consecutive blocks from block 0 (batches may share blocks: only
    one runs at a time and KV values do not matter here)."""
    tables = BlockTableArray(len(rows), MAX_MODEL_LEN // BLOCK_SIZE)
    vocab = runner.model_cfg.vocab_size
    reqs, next_block = [], 0
    for i, (cached, new) in enumerate(rows):
        total = cached + new
        req = Request(
            rid=f"r{i}",
            prompt_len=cached if cached else total,
            token_ids=rng.integers(0, vocab, total).tolist(),
            params=GREEDY,
        )
        req.num_computed = cached
        num_blocks = math.ceil(total / BLOCK_SIZE)
        req.block_table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        assert next_block <= runner.num_usable_blocks, "pool too small for the batch"
        req.table_row = tables.acquire()
        tables.write(req.table_row, 0, req.block_table)
        reqs.append(req)
    num_decode = sum(1 for cached, new in rows if cached and new == 1)
    batch = ScheduledBatch(
        rows=reqs,
        num_new=[new for _, new in rows],
        num_decode=num_decode,
        table_rows=np.array([r.table_row for r in reqs], dtype=np.int64),
    )
    return batch, tables


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
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)

    model_dir = write_dummy_model_dir(os.path.join(tempfile.mkdtemp(), PRESET), PRESET)
    model_cfg = ModelConfig.from_pretrained(model_dir)
    blocks_needed = max(
        max(DECODE_BATCHES) * math.ceil((CONTEXT + 1) / BLOCK_SIZE),
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
        max_running_requests=max(DECODE_BATCHES),
        max_model_len=MAX_MODEL_LEN,
    )
    start = time.perf_counter()
    runner = ModelRunner(cfg, model_cfg, MAX_MODEL_LEN)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    runner.pool.kv.uniform_(-1.0, 1.0)  # random KV: never time on zeros
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
    kv_bytes_per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2
    print(
        f"{PRESET}: weights read per step {weight_bytes / 1e9:.2f} GB, KV {kv_bytes_per_token} "
        f"B/token; runner built in {build_s:.1f} s (dummy weights, KV pool, CUDA graphs)"
    )
    results: dict[str, list[dict]] = {"decode": [], "prefill": [], "profile": []}

    for bsz in DECODE_BATCHES:
        batch, tables = make_batch(runner, [(CONTEXT, 1)] * bsz, rng)
        kv_bytes = bsz * (CONTEXT + 1) * kv_bytes_per_token
        floor_ms = (weight_bytes + kv_bytes) / COPY_BW * 1e3
        for graph in (True, False):
            step = functools.partial(runner.forward, batch, tables, use_cuda_graph=graph)
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
            results["decode"].append(row)
            print(f"decode {row}")
        if args.profile:
            for graph in (True, False):
                case = f"decode B={bsz} graph={graph}"
                step = functools.partial(runner.forward, batch, tables, use_cuda_graph=graph)
                cats = profile(step, 5, args.profile, case)
                results["profile"].append(dict(case=case, ms=cats))
                print(f"profile {case}: {cats}")

    for num_rows, length in PREFILLS:
        batch, tables = make_batch(runner, [(0, length)] * num_rows, rng)
        tokens = num_rows * length
        flops = (
            2 * tokens * linear_params
            + 2 * num_rows * m.hidden_size * m.vocab_size
            + 4 * m.num_layers * m.num_heads * m.head_dim * num_rows * length * (length + 1) / 2
        )
        step = functools.partial(runner.forward, batch, tables)
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
        results["prefill"].append(row)
        print(f"prefill {row}")
        if args.profile:
            case = f"prefill {num_rows}x{length}"
            cats = profile(step, 1, args.profile, case)
            results["profile"].append(dict(case=case, ms=cats))
            print(f"profile {case}: {cats}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(build_s=build_s, weight_bytes=weight_bytes, **results), f, indent=2)
    print(f"\n## One batch (H200, dummy {PRESET}, bf16, block size {BLOCK_SIZE})")
    print("| decode | B | ctx | graph | ms/step | tok/s | graph GPU ms | floor ms | of floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["decode"]:
        gpu = f"{r['graph_gpu_ms']:.2f}" if r["graph_gpu_ms"] is not None else "-"
        print(
            f"| decode | {r['batch']} | {r['context']} | {'yes' if r['cuda_graph'] else 'no'} "
            f"| {r['ms_per_step']:.2f} | {r['tok_per_s']:.0f} | {gpu} | {r['floor_ms']:.2f} "
            f"| {r['fraction_of_floor']:.0%} |"
        )
    print("| prefill | rows x len | | | ms | tok/s | TFLOP/s | floor ms | of floor |")
    for r in results["prefill"]:
        print(
            f"| prefill | {r['rows']}x{r['tokens_per_row']} | | | {r['ms']:.1f} "
            f"| {r['tok_per_s']:.0f} | {r['tflop_per_s']:.0f} | {r['floor_ms']:.1f} "
            f"| {r['fraction_of_floor']:.0%} |"
        )


if __name__ == "__main__":
    main()
