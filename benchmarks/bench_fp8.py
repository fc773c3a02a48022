"""fp8 KV cache vs the model-dtype KV cache: capacity, throughput and quality, side by side.

For each KV dtype (the first is the reference, default `auto` = the model's dtype), one
engine at a time on the same model and weights (dummy weights use one seed):
- capacity: KV blocks, tokens, and how many `input_len + output_len` requests fit at once;
- throughput: the random workload (`--num-requests` x `--input-len`/`--output-len`,
  benchmarks.workloads / engine_driver machinery, greedy, ignore_eos);
- quality vs the reference: `--num-prompts` seeded random prompts, greedy `--gen-len` tokens;
  greedy agreement (tokens equal up to the first divergence / all tokens, and the share of
  outputs identical) and |log-prob difference| per token, teacher-forced: the engine scores
  the reference's own greedy tokens (prompt log-probs), compared with the reference's.

    python -m benchmarks.bench_fp8 --size smoke                       # CPU, tiny model
    python -m benchmarks.bench_fp8 --model DIR --load-format dummy    # H200, Llama-3-8B shape
    python -m benchmarks.bench_fp8 --model DIR --load-format dummy --kv-memory-gb 20

`--kv-memory-gb X` gives every dtype the same X GiB of KV (fp8: twice the blocks), so the
pool, not the batch limit, bounds concurrency. Writes <out>/<tag>.json; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from benchmarks.backends import warmup_workload
from benchmarks.metrics import summarize
from benchmarks.workloads import FIRST_TOKEN, make_workload

SIZES = {  # size -> defaults: throughput workload, quality prompts
    "full": dict(num_requests=256, input_len=1024, output_len=1024, num_prompts=64,
                 prompt_len=256, gen_len=64),
    "smoke": dict(num_requests=16, input_len=64, output_len=16, num_prompts=8,
                  prompt_len=32, gen_len=16),
}  # fmt: skip


@dataclass(frozen=True)
class Quality:
    """One KV dtype against the reference on the same prompts (greedy)."""

    token_agreement: float  # tokens equal before each output's first divergence / all tokens
    identical_outputs: float  # share of outputs equal to the reference's
    mean_abs_logprob_diff: float  # teacher-forced, over every reference token
    max_abs_logprob_diff: float
    num_tokens: int  # reference tokens compared


def greedy(engine, prompts: list[list[int]], gen_len: int) -> list[tuple[list[int], list[float]]]:
    """Greedy continuations [(token ids, their log-probs under the raw model)], EOS ignored."""
    from radixrt import SamplingParams

    sp = SamplingParams(max_tokens=gen_len, temperature=0, logprobs=True, ignore_eos=True)
    return [(o.token_ids, o.logprobs) for o in engine.generate(prompt_token_ids=prompts,
                                                                sampling_params=sp)]  # fmt: skip


def teacher_forced(engine, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
    """log p(output token i | prompt, output < i) under `engine`, per prompt."""
    from radixrt import SamplingParams

    params = [
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True,
                       logprob_start_len=len(p), ignore_eos=True)
        for p in prompts
    ]  # fmt: skip
    seqs = [p + o for p, o in zip(prompts, outputs)]
    outs = engine.generate(prompt_token_ids=seqs, sampling_params=params)
    return [o.prompt_logprobs for o in outs]


def compare(
    reference: list[tuple[list[int], list[float]]],
    candidate: list[list[int]],
    forced: list[list[float]],
) -> Quality:
    """Quality of `candidate` greedy outputs and teacher-forced log-probs `forced` (of the
    reference's tokens) against the reference's (tokens, log-probs)."""
    agree = total = identical = 0
    diffs: list[float] = []
    for (ref_ids, ref_lps), ids, lps in zip(reference, candidate, forced):
        assert len(lps) == len(ref_lps), "scored a different number of tokens"
        same = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), len(ref_ids))
        agree += same
        total += len(ref_ids)
        identical += ids == ref_ids
        diffs += [abs(a - b) for a, b in zip(ref_lps, lps)]
    return Quality(
        token_agreement=agree / max(total, 1),
        identical_outputs=identical / max(len(reference), 1),
        mean_abs_logprob_diff=float(np.mean(diffs)) if diffs else 0.0,
        max_abs_logprob_diff=max(diffs, default=0.0),
        num_tokens=len(diffs),
    )


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_TOKEN, vocab_size, size=(n, length)).tolist()


def kv_blocks_for_memory(model_dir: str, gib: float, kv_cache_dtype: str, args) -> int:
    """Blocks of `kv_cache_dtype` in `gib` GiB for this model (same bytes for every dtype)."""
    import torch

    from radixrt.config import ModelConfig
    from radixrt.kv.pool import KVPool, kv_storage_dtype
    from radixrt.model import DTYPES

    mc = ModelConfig.from_pretrained(model_dir)
    cuda = args.device != "cpu" and torch.cuda.is_available()
    model_dtype = DTYPES[args.dtype] if args.dtype != "auto" else torch.bfloat16
    head_dim = mc.head_dim
    if cuda:  # FlashInfer pads small heads: the pool stores the padded dim
        from radixrt.attention.flashinfer_backend import kv_head_dim

        head_dim = kv_head_dim(mc.head_dim)
    per_block = KVPool.bytes_per_block(
        mc.num_layers, args.block_size, mc.num_kv_heads, head_dim,
        kv_storage_dtype(kv_cache_dtype, model_dtype if cuda else torch.float32),
    )  # fmt: skip
    return int(gib * 2**30 // per_block)


def run_one(args, model: str, kv_cache_dtype: str, sizes: dict, reference) -> dict:
    """Capacity, throughput and greedy outputs (+ quality when `reference` is given) of one
    engine with `kv_cache_dtype`; the engine is shut down before returning."""
    from benchmarks.engine_driver import run_engine
    from radixrt import Engine

    opts = dict(device=args.device, dtype=args.dtype, load_format=args.load_format,
                block_size=args.block_size, kv_cache_dtype=kv_cache_dtype,
                max_running_requests=args.max_running_requests,
                max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    if args.kv_memory_gb is not None:
        opts["num_kv_blocks"] = kv_blocks_for_memory(model, args.kv_memory_gb, kv_cache_dtype,
                                                     args)  # fmt: skip
    elif args.num_kv_blocks is not None:
        opts["num_kv_blocks"] = args.num_kv_blocks
    if args.threads and args.device in ("cpu", "auto"):
        opts["cpu_threads"] = args.threads
    start = time.perf_counter()
    engine = Engine(model, **opts)
    try:
        stats = engine.stats()
        bs = engine.config.cache.block_size
        per_request = math.ceil((sizes["input_len"] + sizes["output_len"]) / bs)
        blocks = int(stats["kv_blocks_total"])
        row = {
            "kv_cache_dtype": kv_cache_dtype,
            "startup_s": time.perf_counter() - start,
            "kv_blocks": blocks,
            "kv_tokens": blocks * bs,
            "max_concurrent_requests": min(blocks // per_request, args.max_running_requests),
            "max_concurrent_requests_by_kv": blocks // per_request,
        }
        vocab = engine.model_config.vocab_size
        run_engine(engine, warmup_workload(vocab))
        engine.cache.reset()
        workload = make_workload("random", args.size, 1.0, args.seed, vocab,
                                 num_requests=sizes["num_requests"],
                                 input_len=sizes["input_len"],
                                 output_len=sizes["output_len"])  # fmt: skip
        result = run_engine(engine, workload, timeout_s=args.run_timeout_s)
        engine.check_integrity()
        engine.cache.reset()
        s = summarize(result)
        keep = ("complete", "duration_s", "output_throughput", "total_throughput", "ttft_ms",
                "itl_ms", "peak_kv_blocks_used", "preemptions", "mean_step_ms")  # fmt: skip
        row.update({k: s[k] for k in keep})
        prompts = random_prompts(sizes["num_prompts"], sizes["prompt_len"], vocab, args.seed)
        outputs = greedy(engine, prompts, sizes["gen_len"])
        if reference is not None:
            forced = teacher_forced(engine, prompts, [ids for ids, _ in reference])
            row["quality"] = compare(reference, [ids for ids, _ in outputs], forced).__dict__
        engine.check_integrity()
        return {"row": row, "outputs": outputs}
    finally:
        engine.shutdown()
        del engine
        _free_device()


def _free_device() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def format_table(rows: list[dict]) -> str:
    head = (
        "| kv dtype | KV blocks | KV tokens | max concurrent (kv) | out tok/s | TTFT p50 ms "
        "| ITL p50 ms | preempt | greedy agree | identical | mean abs dlogp | max abs dlogp |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        q = r.get("quality")
        qs = (f"{100 * q['token_agreement']:.1f}% | {100 * q['identical_outputs']:.1f}% | "
              f"{q['mean_abs_logprob_diff']:.4f} | {q['max_abs_logprob_diff']:.4f}"
              if q else "reference | | |")  # fmt: skip
        lines.append(
            f"| {r['kv_cache_dtype']} | {r['kv_blocks']} | {r['kv_tokens']} | "
            f"{r['max_concurrent_requests']} ({r['max_concurrent_requests_by_kv']}) | "
            f"{r['output_throughput']:.0f} | {r['ttft_ms']['p50']:.1f} | "
            f"{r['itl_ms']['p50']:.2f} | {r['preemptions']} | {qs} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: the tiny model)")
    p.add_argument("--kv-cache-dtypes", default="auto,fp8_e4m3",
                   help="comma list; the first is the reference")  # fmt: skip
    p.add_argument("--size", default="full", choices=list(SIZES))
    for name in SIZES["full"]:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--kv-memory-gb", type=float, default=None,
                   help="KV memory of every dtype (GiB; default: the engine's sizing)")  # fmt: skip
    p.add_argument("--num-kv-blocks", type=int, default=None, help="same blocks for every dtype")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--run-timeout-s", type=float, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--tag", default="fp8")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from radixrt.model.tiny import ensure_tiny_model

        model = ensure_tiny_model()
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v
             for k, v in SIZES[args.size].items()}  # fmt: skip
    rows, reference = [], None
    for i, kd in enumerate(d for d in args.kv_cache_dtypes.split(",") if d):
        res = run_one(args, model, kd, sizes, reference)
        if i == 0:
            reference = res["outputs"]
        rows.append(res["row"])
        print(json.dumps(res["row"]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump({"args": vars(args), "model": model, "sizes": sizes, "rows": rows}, f, indent=1)
    print()
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
