"""Multi-LoRA serving through EngineCore against the base model alone: decode steps and serving
throughput with 1, 8 or 32 adapters mixed in the batch, the cost of swapping an adapter in, and
multi-turn sessions that each reuse their own adapter's prefix cache.

The model is a preset of radixrt.model.presets with random weights (`--model llama-3-8b`) or
`tiny` (the trained tiny checkpoint: the CPU check). Adapters are written as PEFT directories
(adapter_config.json + adapter_model.safetensors) of rank R over q, k, v, o, gate, up and down:
A ~ N(0, 1/in), B ~ N(0, 1/R), a delta comparable to the base output. The adapters of one
rank share one weights file (hard links) and differ in lora_alpha (scaling 0.5 to 1), which
gives each its own key, slot and delta without writing gigabytes of 8B-shaped files.

Per rank one engine serves every adapter count (`max_loras` = the largest of `--adapters`);
`--adapters 0` is a second engine with LoRA off. Rows are spread round-robin over the
adapters. Each KV pool holds the largest batch and no more. The radix prefix cache is on (the
sessions need it) and flushed before every cell, so the other cells compute all their prompts.

- decode: B requests of `--context` random prompt tokens; once every row has `--warmup`
  output tokens, `--iters` decode steps: ms per step (median of the host wall time of
  `core.step()`: with overlap the pipelined step period, with `--overlap off` a step that
  waits for its own tokens) and tokens/s over the window (device synchronised at both ends).
- serve: `--serve-requests` requests of `--serve-prompt` random tokens and `--serve-output`
  output tokens, all added at once, run to the end: output tokens/s. The prompts are the same
  in every cell; `changed_vs_base` counts the requests whose greedy output differs from the
  base model's (adapters that change nothing would measure nothing).
- swap: with every slot full, `LoraSlots.assign` of an adapter in no slot (median ms, device
  synchronised): read from its directory (the host cache misses; the file is in the page
  cache, just written), and from the host cache (`max_cpu_loras` keeps the evicted ones).
- sessions: `--sessions` chats over the largest adapter count's adapters round-robin (the base
  model on the base engine), `--session-turns` turns each; a turn's prompt is the session's
  history (earlier prompts and answers) + `--session-chunk` new random tokens, answered with
  `--session-output` tokens; every session's turn k runs at once, then turn k + 1. Over turns
  2..: the prefix cache's hit rate (cached / prompt tokens, `num_cached_tokens`), overall and
  per adapter (min / median / max), against `history_share` (history / prompt tokens, its
  ceiling), and output tokens/s. A probe then runs one fresh prompt under the first adapter,
  the second and the base, then the first again: the others must reuse none of it
  (`cross_cached`, else the cell fails) and the first must (`own_cached` > 0: the cache is on).
Decode steps replay CUDA graphs, with the adapters' deltas where a row has one (each bucket's
LoRA graph, radixrt.executor.cuda_graph); prefill steps run eagerly.
`vs_base` is tokens/s over the base model's at the same batch (1.0: no cost).

    python -m benchmarks.bench_lora_engine [--model llama-3-8b] [--adapters 0,1,8,32]
        [--ranks 16,64] [--batches 32,256] [--serve-requests 256] [--sessions 16]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from safetensors.torch import save_file

from radixrt.config import ModelConfig, resolve_config
from radixrt.deltas import FinishReason, RequestDelta
from radixrt.engine.core import EngineCore
from radixrt.lora import LoraRegistry
from radixrt.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, module_shapes
from radixrt.model.presets import PRESETS, write_dummy_model_dir
from radixrt.sampling import DEFAULT_OPTIONS, LoraRef, RequestOptions, SamplingParams

BLOCK_SIZE = 16
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_adapters(
    model_path: str, model_cfg: ModelConfig, out_dir: str, rank: int, count: int, device: str
) -> list[str]:
    """`count` PEFT adapter directories of rank `rank` for `model_cfg` in out_dir (see the
    module docstring: one random weights file, hard-linked; lora_alpha differs). Returns them."""
    gen = torch.Generator(device).manual_seed(rank)
    tensors = {}
    for layer in range(model_cfg.num_layers):
        for module, (fan_in, fan_out) in module_shapes(model_cfg).items():
            kind = "self_attn" if module in ATTENTION_MODULES else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            a = torch.randn(rank, fan_in, generator=gen, device=device) / math.sqrt(fan_in)
            b = torch.randn(fan_out, rank, generator=gen, device=device) / math.sqrt(rank)
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
    paths = []
    for i in range(count):
        path = os.path.join(out_dir, f"r{rank}-{i}")
        os.makedirs(path)
        weights = os.path.join(path, WEIGHTS_FILE)
        if paths:
            os.link(os.path.join(paths[0], WEIGHTS_FILE), weights)
        else:
            save_file(tensors, weights)
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": rank * (0.5 + 0.5 * i / count),
            "target_modules": list(module_shapes(model_cfg)),
            "bias": "none",
            "base_model_name_or_path": model_path,
        }
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(config, f)
        paths.append(path)
    return paths


def progress(args: argparse.Namespace, kind: str, row: dict) -> None:
    print(f"[{time.perf_counter() - args.started:4.0f} s] {kind} {row}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_core(
    model_path: str, model_cfg: ModelConfig, args: argparse.Namespace, lora: dict[str, int]
) -> EngineCore:
    """The engine of one set of cells: `args.max_rows` rows of up to `args.max_len` tokens, a
    KV pool of that size; `lora`: its LoRA options (empty: LoRA off)."""
    blocks_per_row = math.ceil(args.max_len / BLOCK_SIZE) + 1  # + one a step may plan ahead
    # a session row also holds its history's partly filled last block, which its copy replaces
    session_blocks = args.sessions * (blocks_per_row + 1)
    options: dict[str, object] = dict(
        prefix_cache="radix",  # for the sessions; the other cells flush it first
        policy="fcfs",  # the order the other cells had without a cache (no prefix to prefer)
        block_size=BLOCK_SIZE,
        max_running_requests=args.max_rows,
        # + the CUDA-graph scratch block
        num_kv_blocks=max(args.max_rows * blocks_per_row, session_blocks) + 1,
        max_model_len=args.max_len,
        **lora,
    )
    if args.model != "tiny":
        options["load_format"] = "dummy"
    if args.overlap != "auto":
        options["overlap_schedule"] = args.overlap == "on"
    cfg = resolve_config(model_path, args.device, **options)
    return EngineCore(cfg, model_cfg, model_cfg.eos_token_ids)


def round_robin(refs: Sequence[LoraRef]) -> Callable[[int], RequestOptions]:
    """Row i's options: adapter i mod len(refs), or the base model when refs is empty."""
    options = [RequestOptions(lora=ref) for ref in refs]
    return lambda i: options[i % len(options)] if options else DEFAULT_OPTIONS


def decode_cell(core: EngineCore, refs: Sequence[LoraRef], batch: int, args) -> dict:
    """ms per decode step and tokens/s of `batch` rows over `refs` (module docstring)."""
    core.flush_cache()  # an earlier cell's prompts (the same per batch) would be cached
    rng = np.random.default_rng(batch)
    vocab = core.model_config.vocab_size
    max_tokens = args.warmup + args.iters + args.decode_slack
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    options = round_robin(refs)
    rids = [
        core.add_request(rng.integers(0, vocab, args.context).tolist(), params, options=options(i))
        for i in range(batch)
    ]
    while any(r.num_output < args.warmup for r in core.scheduler.requests.values()):
        core.step()
    sync(args.device)
    times, tokens = [], 0
    start = time.perf_counter()
    for _ in range(args.iters):
        t0 = time.perf_counter()
        tokens += sum(len(d.new_token_ids) for d in core.step())
        times.append((time.perf_counter() - t0) * 1e3)
    sync(args.device)
    wall_s = time.perf_counter() - start
    for rid in rids:
        core.abort(rid)
    while core.has_work:
        core.step()
    core.check_integrity()
    if tokens != batch * args.iters:  # a row failed or waited: the cell measured something else
        raise RuntimeError(f"{tokens} tokens in {args.iters} steps of {batch} rows")
    return dict(batch=batch, ms_per_step=statistics.median(times), tok_per_s=tokens / wall_s)


def run_requests(
    core: EngineCore,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    options: Callable[[int], RequestOptions],
) -> tuple[list[list[int]], list[int]]:
    """Add every prompt (prompt i with `options(i)`) at once and step until the engine is idle.
    Returns each request's output tokens and its prompt tokens the prefix cache served; raises
    unless every request finished by length."""
    rids = [core.add_request(p, params, options=options(i)) for i, p in enumerate(prompts)]
    outputs: dict[str, list[int]] = {rid: [] for rid in rids}
    last: dict[str, RequestDelta] = {}
    while core.has_work:
        for d in core.step():
            outputs[d.rid] += d.new_token_ids
            last[d.rid] = d
    core.check_integrity()
    reasons = [(rid, last[rid].finish_reason if rid in last else None) for rid in rids]
    failed = [(rid, reason) for rid, reason in reasons if reason != FinishReason.LENGTH]
    if failed:
        raise RuntimeError(f"{len(failed)} requests did not finish by length: {failed[:3]}")
    return [outputs[rid] for rid in rids], [last[rid].num_cached_tokens for rid in rids]


def serve_cell(core: EngineCore, refs: Sequence[LoraRef], args) -> tuple[dict, list[list[int]]]:
    """Output tokens/s of `args.serve_requests` requests over `refs`, all added at once (module
    docstring); and each request's output tokens."""
    core.flush_cache()  # the prompts are the same in every cell
    rng = np.random.default_rng(0)  # the same prompts in every cell
    vocab = core.model_config.vocab_size
    prompts = [
        rng.integers(0, vocab, args.serve_prompt).tolist() for _ in range(args.serve_requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.serve_output, ignore_eos=True)
    sync(args.device)
    start = time.perf_counter()
    outputs, _ = run_requests(core, prompts, params, round_robin(refs))
    sync(args.device)
    wall_s = time.perf_counter() - start
    tokens = sum(len(out) for out in outputs)
    row = dict(requests=len(prompts), output_tok_s=tokens / wall_s, wall_s=wall_s)
    return row, outputs


def session_cell(core: EngineCore, refs: Sequence[LoraRef], args) -> dict:
    """Prefix-cache hit rates and output tokens/s of `args.sessions` multi-turn sessions over
    `refs` (round-robin; the base model when empty), then the isolation probe (module
    docstring). Raises if an adapter reused another namespace's cache or the cache is off."""
    core.flush_cache()  # turn 1 starts cold; hits come from the sessions' own turns
    rng = np.random.default_rng(1)
    vocab = core.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.session_output, ignore_eos=True)
    options = round_robin(refs)
    names = [options(i).lora.name if options(i).lora else "base" for i in range(args.sessions)]
    histories: list[list[int]] = [[] for _ in range(args.sessions)]
    # adapter name -> (cached, prompt, history) tokens over turns 2..
    totals = {name: np.zeros(3, dtype=np.int64) for name in names}
    output_tokens, wall_s = 0, 0.0
    for turn in range(args.session_turns):
        chunks = [rng.integers(0, vocab, args.session_chunk).tolist() for _ in histories]
        prompts = [h + c for h, c in zip(histories, chunks)]
        sync(args.device)
        start = time.perf_counter()
        outputs, cached = run_requests(core, prompts, params, options)
        sync(args.device)
        if turn > 0:
            wall_s += time.perf_counter() - start
            output_tokens += sum(len(out) for out in outputs)
            for name, n, prompt, history in zip(names, cached, prompts, histories):
                totals[name] += (n, len(prompt), len(history))
        histories = [p + out for p, out in zip(prompts, outputs)]
    cached, prompt, history = (int(x) for x in sum(totals.values()))
    per_adapter = [float(t[0] / t[1]) for t in totals.values()]
    row = dict(
        sessions=args.sessions,
        turns=args.session_turns,
        hit_rate=cached / prompt,
        history_share=history / prompt,
        hit_rate_min=min(per_adapter),
        hit_rate_median=statistics.median(per_adapter),
        hit_rate_max=max(per_adapter),
        output_tok_s=output_tokens / wall_s,
        wall_s=wall_s,
    )
    return dict(row, **isolation_probe(core, refs, rng, args))


def isolation_probe(core: EngineCore, refs: Sequence[LoraRef], rng, args) -> dict:
    """One fresh prompt run alone under refs[0], refs[1] and the base in turn, then under
    refs[0] again: `cross_cached`, the tokens the later namespaces got from the earlier ones
    (None without adapters), must be 0 and `own_cached` (the repeat's) must not."""
    prompt = rng.integers(0, core.model_config.vocab_size, args.session_chunk).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    namespaces = [[ref] for ref in refs[:2]] + [[]]  # []: the base model
    cached = [
        run_requests(core, [prompt], params, round_robin(ns))[1][0]
        for ns in [*namespaces, namespaces[0]]
    ]
    cross, own = sum(cached[1:-1]), cached[-1]
    if cached[0] or cross or not own:  # the first run is cold: nothing may be cached
        raise RuntimeError(f"cache namespaces leak or the cache is off: cached {cached}")
    return dict(own_cached=own, cross_cached=cross if refs else None)


def timed_assigns(core: EngineCore, refs: Sequence[LoraRef], host_reads: int, device: str):
    """ms of `LoraSlots.assign` for each of `refs` alone, each of which must swap into a slot
    and read its directory `host_reads` (0 or 1) times."""
    slots = core.runner.lora
    times = []
    for ref in refs:
        swaps, reads = slots.num_swaps_in, slots.num_host_reads
        sync(device)
        start = time.perf_counter()
        slots.assign([ref])
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        assert (slots.num_swaps_in, slots.num_host_reads) == (swaps + 1, reads + host_reads)
    return times


def swap_cells(core: EngineCore, resident: list[LoraRef], extra: list[LoraRef], args) -> list:
    """Swap-in ms (module docstring): `resident` fill every slot; each of `extra` (in no slot,
    not in the host cache) comes from its directory, then the adapters they evicted come
    back from the host cache."""
    slots = core.runner.lora
    for ref in resident:
        slots.assign([ref])
    assert None not in slots.slot_keys, "swap cells need every slot full"
    disk = timed_assigns(core, extra, 1, args.device)
    evicted = [ref for ref in resident if ref.key not in slots.slot_keys]
    host = timed_assigns(core, evicted, 0, args.device)
    mb = os.path.getsize(os.path.join(extra[0].path, WEIGHTS_FILE)) / 1e6
    return [
        dict(source=source, ms=statistics.median(t), ms_all=t, adapter_file_mb=mb)
        for source, t in (("disk", disk), ("host", host))
    ]


def load_adapters(model_path, model_cfg, args, rank: int, count: int, out_dir: str) -> list:
    """`count` adapters of rank `rank` written into out_dir and loaded (`LoraRegistry`)."""
    paths = write_adapters(model_path, model_cfg, out_dir, rank, count, args.device)
    registry = LoraRegistry(model_cfg, rank)
    return [registry.load(os.path.basename(p), p) for p in paths]


def run_engine(
    model_path: str,
    model_cfg: ModelConfig,
    args: argparse.Namespace,
    rank: int | None,
    counts: list[int],
    adapter_dir: str,
    results: dict,
    base_outputs: list[list[int]] | None,
) -> list[list[int]] | None:
    """Every cell of `counts` adapters of rank `rank` on one engine (rank None: the base
    model, LoRA off, counts [0]); rows appended to `results`, `changed_vs_base` against
    `base_outputs`. Returns the base model's serving outputs (None if not served here)."""
    lora, extra = {}, 0
    if rank is not None:
        extra = args.swap_iters
        lora = dict(max_loras=max(counts), max_lora_rank=rank, max_cpu_loras=max(counts) + extra)
    start = time.perf_counter()
    core = build_core(model_path, model_cfg, args, lora)
    sync(args.device)
    cfg = core.config
    engine = dict(rank=rank, build_s=time.perf_counter() - start, dtype=cfg.dtype, **lora)
    engine.update(attention=cfg.attention_backend, cuda_graphs=cfg.enable_cuda_graph)
    engine.update(overlap=cfg.overlap_schedule)
    refs: list[LoraRef] = []
    if rank is not None:
        start = time.perf_counter()
        refs = load_adapters(model_path, model_cfg, args, rank, max(counts) + extra, adapter_dir)
        engine["adapters_s"] = time.perf_counter() - start
    progress(args, "engine", engine)
    start = time.perf_counter()
    for n in counts:
        label = dict(rank=rank, adapters=n)
        for batch in args.batches:
            row = dict(label, **decode_cell(core, refs[:n], batch, args))
            results["decode"].append(row)
            progress(args, "decode", row)
        if args.serve_requests:
            row, outputs = serve_cell(core, refs[:n], args)
            row = dict(label, **row)
            if n == 0:
                base_outputs = outputs
            if base_outputs is not None:
                row["changed_vs_base"] = sum(a != b for a, b in zip(outputs, base_outputs))
            results["serve"].append(row)
            progress(args, "serve", row)
    if args.sessions:
        row = dict(rank=rank, adapters=max(counts), **session_cell(core, refs[: max(counts)], args))
        results["sessions"].append(row)
        progress(args, "sessions", row)
    if extra:
        for row in swap_cells(core, refs[: max(counts)], refs[max(counts) :], args):
            results["swap"].append(dict(rank=rank, max_loras=max(counts), **row))
            progress(args, "swap", results["swap"][-1])
    if rank is not None:
        engine.update(swaps_in=core.runner.lora.num_swaps_in)
        engine.update(host_reads=core.runner.lora.num_host_reads)
    engine["cells_s"] = time.perf_counter() - start
    results["engines"].append(engine)
    core.shutdown()
    del core
    gc.collect()  # the next engine needs the device memory (cycles hold the graphs)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return base_outputs if rank is None else None


def add_ratios(results: dict) -> None:
    """`vs_base` on every decode and serve row: its tokens/s over the base model's (same
    batch), None without a base row."""
    base = {r["batch"]: r["tok_per_s"] for r in results["decode"] if r["adapters"] == 0}
    for r in results["decode"]:
        r["vs_base"] = r["tok_per_s"] / base[r["batch"]] if r["batch"] in base else None
    serve_base = [r["output_tok_s"] for r in results["serve"] if r["adapters"] == 0]
    for r in results["serve"]:
        r["vs_base"] = r["output_tok_s"] / serve_base[0] if serve_base else None


def print_tables(results: dict, title: str, args) -> None:
    ratio = lambda r: "-" if r["vs_base"] is None else f"{r['vs_base']:.2f}"  # noqa: E731
    rank = lambda r: "-" if r["rank"] is None else r["rank"]  # noqa: E731
    print(f"\n## Multi-LoRA decode ({title}, context {args.context})")
    print("| rank | adapters | B | ms/step | tok/s | vs base |")
    print("|---|---|---|---|---|---|")
    for r in results["decode"]:
        print(
            f"| {rank(r)} | {r['adapters']} | {r['batch']} | {r['ms_per_step']:.2f} "
            f"| {r['tok_per_s']:.0f} | {ratio(r)} |"
        )
    if results["serve"]:
        print(
            f"\n## Multi-LoRA serving ({title}, {args.serve_requests} requests of "
            f"{args.serve_prompt} prompt / {args.serve_output} output tokens, added at once)"
        )
        print("| rank | adapters | output tok/s | wall s | vs base | outputs changed |")
        print("|---|---|---|---|---|---|")
        for r in results["serve"]:
            changed = r.get("changed_vs_base")
            print(
                f"| {rank(r)} | {r['adapters']} | {r['output_tok_s']:.0f} | {r['wall_s']:.2f} "
                f"| {ratio(r)} | {'-' if changed is None else changed} |"
            )
    if results["sessions"]:
        print(
            f"\n## Multi-LoRA sessions ({title}, {args.sessions} sessions x "
            f"{args.session_turns} turns of history + {args.session_chunk} new prompt / "
            f"{args.session_output} output tokens; turns 2..)"
        )
        print(
            "| rank | adapters | hit rate | history share | per adapter min / median / max "
            "| output tok/s | cross-adapter cached |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in results["sessions"]:
            cross = "-" if r["cross_cached"] is None else r["cross_cached"]
            print(
                f"| {rank(r)} | {r['adapters']} | {r['hit_rate']:.3f} | {r['history_share']:.3f} "
                f"| {r['hit_rate_min']:.3f} / {r['hit_rate_median']:.3f} / "
                f"{r['hit_rate_max']:.3f} | {r['output_tok_s']:.0f} | {cross} |"
            )
    if results["swap"]:
        print(f"\n## Adapter swap-in ({title}, every slot full; median ms of n swaps)")
        print("| rank | max_loras | from | n | ms | adapter file MB |")
        print("|---|---|---|---|---|---|")
        for r in results["swap"]:
            print(
                f"| {r['rank']} | {r['max_loras']} | {r['source']} | {len(r['ms_all'])} "
                f"| {r['ms']:.1f} | {r['adapter_file_mb']:.1f} |"
            )


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b", choices=["tiny", *sorted(PRESETS)])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--adapters", type=int_list, default=[0, 1, 8, 32], help="0: the base")
    ap.add_argument("--ranks", type=int_list, default=[16, 64])
    ap.add_argument("--batches", type=int_list, default=[32, 256], help="decode rows")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of a decode row")
    ap.add_argument("--warmup", type=int, default=5, help="output tokens before timing")
    ap.add_argument("--iters", type=int, default=30, help="timed decode steps")
    ap.add_argument("--serve-requests", type=int, default=256, help="0: no serving runs")
    ap.add_argument("--serve-prompt", type=int, default=512)
    ap.add_argument("--serve-output", type=int, default=128)
    ap.add_argument("--swap-iters", type=int, default=8, help="swap-ins timed; 0: none")
    ap.add_argument("--sessions", type=int, default=16, help="multi-turn sessions; 0: none")
    ap.add_argument("--session-turns", type=int, default=4)
    ap.add_argument("--session-chunk", type=int, default=128, help="new prompt tokens a turn")
    ap.add_argument("--session-output", type=int, default=32, help="output tokens a turn")
    ap.add_argument("--overlap", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--json", help="write every number here")
    args = ap.parse_args(argv)
    args.started = time.perf_counter()
    if any(n < 0 for n in args.adapters) or len(set(args.adapters)) != len(args.adapters):
        ap.error(f"--adapters must be distinct counts >= 0, got {args.adapters}")
    if any(b < 1 for b in args.batches) or min(args.warmup, args.iters) < 1:
        ap.error("--batches, --warmup and --iters must be >= 1")
    if min(args.context, args.serve_prompt, args.serve_output) < 1:
        ap.error("--context, --serve-prompt and --serve-output must be >= 1")
    if min(args.serve_requests, args.swap_iters, args.sessions) < 0:
        ap.error("--serve-requests, --swap-iters and --sessions must be >= 0")
    # turn 2 is the first with a history; the probe's repeat needs a token before its last
    if args.session_turns < 2 or args.session_chunk < 2 or args.session_output < 1:
        ap.error("--session-turns and --session-chunk must be >= 2, --session-output >= 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.decode_slack = 8  # output tokens a decode row may still make after the timed steps
    args.max_rows = max(args.batches + [args.serve_requests, args.sessions])
    args.max_len = max(
        args.context + args.warmup + args.iters + args.decode_slack,
        args.serve_prompt + args.serve_output,
        args.session_turns * (args.session_chunk + args.session_output) if args.sessions else 0,
    )
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Run every cell the arguments ask for; print the tables, write --json; returns what
    --json holds."""
    args = parse_args(argv)
    torch.manual_seed(0)
    results: dict = dict(decode=[], serve=[], sessions=[], swap=[], engines=[])
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        if args.model == "tiny":
            from radixrt.model.tiny import ensure_tiny_model

            model_path = ensure_tiny_model()
        else:
            model_path = write_dummy_model_dir(os.path.join(tmp, args.model), args.model)
        model_cfg = ModelConfig.from_pretrained(model_path)
        counts = sorted(n for n in args.adapters if n > 0)
        base = None
        if 0 in args.adapters:
            base = run_engine(model_path, model_cfg, args, None, [0], tmp, results, None)
        for rank in args.ranks if counts else []:
            run_engine(model_path, model_cfg, args, rank, counts, tmp, results, base)
    add_ratios(results)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    title = f"{gpu}, {args.model}{'' if args.model == 'tiny' else ' dummy'}"
    config = {k: v for k, v in vars(args).items() if k != "started"}
    results["config"] = dict(config, gpu=gpu, total_s=time.perf_counter() - args.started)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"total {results['config']['total_s']:.0f} s")
    print_tables(results, title, args)
    return results


if __name__ == "__main__":
    main()
