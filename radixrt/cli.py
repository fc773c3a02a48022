"""`radixrt` command line: demo, make-tiny-model, generate, serve."""

from __future__ import annotations

import argparse
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that builds an engine."""
    from radixrt.config import DECODE_ATTENTION_KERNELS  # torch-free

    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="cpu | cuda | auto (default)")
    g.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto")
    g.add_argument("--prefix-cache", default="radix", choices=["radix", "blockhash", "none"])
    g.add_argument("--policy", default="auto", help="fcfs | lpm | dfs-weight | random | auto")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--mem-fraction", type=float, default=0.85)
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3"],
        help="KV storage: the model dtype (auto) or fp8 e4m3 with per-tensor scales (2x tokens)",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="fp8: W8A8 fp8 linear layers, a 16/32-bit checkpoint quantized at load (fp8 "
        "checkpoints run in fp8 without it); CUDA compute capability >= 8.9",
    )
    g.add_argument(
        "--fp8-activation-scale",
        default="auto",
        choices=["auto", "token", "tensor"],
        help="fp8 activation scaling when quantizing at load: token (dynamic per token, "
        "per-channel weight scales; auto) or tensor (dynamic per tensor, per-tensor weight "
        "scales)",
    )
    g.add_argument(
        "--host-kv-gb",
        type=float,
        default=0.0,
        help="host KV tier (radix cache): GiB of host memory for evicted KV blocks; 0: off",
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument(
        "--attention-backend", default="auto", help="torch | torch-reference | flashinfer | auto"
    )
    g.add_argument(
        "--decode-attention-kernel",
        default="auto",
        choices=DECODE_ATTENTION_KERNELS,
        help="flashinfer decode kernel: auto = xqa (fp8 q) for an fp8 KV cache on Hopper, else fa2",
    )
    g.add_argument("--disable-cuda-graph", action="store_true")
    g.add_argument(
        "--kv-events-hash-seed",
        default=None,
        help="KV events: the seed of vLLM's NONE_HASH (block 0's parent hash); default: "
        "$PYTHONHASHSEED, else random (routers that hash tokens need the same seed)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        help="ranks (GPUs; rank r on cuda:r) that share each layer; 1: off",
    )
    g.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="plan each step only after the previous one finished (overlap is on for CUDA)",
    )
    g.add_argument(
        "--speculative-method",
        default="none",
        choices=["none", "ngram", "radix", "draft"],
        help="draft tokens by prompt lookup (ngram), from the radix cache (radix) or with a "
        "draft model (draft: needs --speculative-draft-model)",
    )
    g.add_argument(
        "--speculative-draft-model",
        default=None,
        help="draft: HF dir of a smaller checkpoint with the target's tokenizer",
    )
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per decode row")
    g.add_argument(
        "--speculative-min-gain",
        type=float,
        default=0.3,
        help="verify drafts in a step only when its expected accepted drafts reach this many "
        "per decode row (0: always)",
    )
    g.add_argument("--ngram-min-n", type=int, default=2, help="ngram: shortest suffix matched")
    g.add_argument("--ngram-max-n", type=int, default=4, help="ngram: longest suffix matched")
    g.add_argument(
        "--retention-max-ttl-s",
        type=float,
        default=600.0,
        help="retention hints: a request's cache_ttl_s is capped at this many seconds",
    )
    g.add_argument(
        "--retention-max-share",
        type=float,
        default=0.8,
        help="retention hints: held blocks stay within this share of the KV pool",
    )
    g.add_argument(
        "--retention-max-tenant-share",
        type=float,
        default=1.0,
        help="retention hints: one cache salt's held blocks stay within this share of the pool",
    )
    g.add_argument(
        "--disable-jump-forward",
        action="store_true",
        help="structured output: sample tokens the grammar forces instead of appending them",
    )
    g.add_argument(
        "--jump-forward-retokenize",
        action="store_true",
        help="also append forced strings as xgrammar tokenizes them (not output-identical)",
    )
    g.add_argument(
        "--grammar-compile-timeout-s",
        type=float,
        default=30.0,
        help="a compile that runs longer fails (its worker process is killed)",
    )
    g.add_argument(
        "--grammar-compile-workers", type=int, default=2, help="grammar compiles at once"
    )
    g.add_argument(
        "--grammar-cache-mb",
        type=float,
        default=256.0,
        help="compiled grammars kept (least recently used dropped first), MiB",
    )


def engine_options(args: argparse.Namespace) -> dict:
    """Engine keyword arguments from parsed `_engine_args` options."""
    opts = {
        "device": args.device,
        "dtype": args.dtype,
        "prefix_cache": args.prefix_cache,
        "policy": args.policy,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "mem_fraction": args.mem_fraction,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "fp8_activation_scale": args.fp8_activation_scale,
        "host_kv_gb": args.host_kv_gb,
        "kv_events_hash_seed": args.kv_events_hash_seed,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_running_requests": args.max_running_requests,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "max_model_len": args.max_model_len,
        "load_format": args.load_format,
        "attention_backend": args.attention_backend,
        "decode_attention_kernel": args.decode_attention_kernel,
        "tensor_parallel_size": args.tensor_parallel_size,
        "speculative_method": args.speculative_method,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_min_gain": args.speculative_min_gain,
        "ngram_min_n": args.ngram_min_n,
        "ngram_max_n": args.ngram_max_n,
        "speculative_draft_model": args.speculative_draft_model,
        "grammar_compile_timeout_s": args.grammar_compile_timeout_s,
        "grammar_compile_workers": args.grammar_compile_workers,
        "grammar_cache_bytes": int(args.grammar_cache_mb * 2**20),
        "jump_forward": not args.disable_jump_forward,
        "jump_forward_retokenize": args.jump_forward_retokenize,
        "retention_max_ttl_s": args.retention_max_ttl_s,
        "retention_max_share": args.retention_max_share,
        "retention_max_tenant_share": args.retention_max_tenant_share,
    }
    if args.disable_cuda_graph:
        opts["enable_cuda_graph"] = False
    if args.disable_overlap_schedule:
        opts["overlap_schedule"] = False
    return opts


def cmd_make_tiny_model(args: argparse.Namespace) -> None:
    from radixrt.model.tiny import make_tiny_model

    print(make_tiny_model(args.dir, seed=args.seed, random=args.random))


def cmd_demo(args: argparse.Namespace) -> None:
    """The runtime's features on the tiny model (radixrt.demo)."""
    from radixrt import Engine
    from radixrt.demo import run_demo
    from radixrt.model.tiny import TINY_MODEL_LINE, ensure_tiny_model, tiny_model_ready

    if args.model is None and not tiny_model_ready():
        print("training the tiny model on first use (1-2 minutes on one core)...", flush=True)
    model = args.model or ensure_tiny_model()
    line = f"{model}" if args.model else f"the tiny model, {TINY_MODEL_LINE} ({model})"
    engine = Engine(model, **engine_options(args))
    try:
        checks = run_demo(engine, args.max_tokens, line)
    finally:
        engine.shutdown()
    if not all(checks.values()):
        sys.exit(1)


def cmd_generate(args: argparse.Namespace) -> None:
    from radixrt import Engine, SamplingParams

    engine = Engine(args.model, **engine_options(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for delta in engine.generate_stream([args.prompt], params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    print()
    engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run a short demo on the tiny model (CPU is fine)")
    p.add_argument("--model", default=None, help="model dir (default: the tiny model)")
    p.add_argument("--max-tokens", type=int, default=24, help="per answer / sample")
    _engine_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "make-tiny-model", help="write the tiny checkpoint to DIR (trained on CPU, ~1 min)"
    )
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random", action="store_true", help="random weights (no training)")
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("generate", help="generate from one prompt, streaming")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    _engine_args(p)
    p.set_defaults(func=cmd_generate)

    from radixrt.server.launch import add_serve_command

    add_serve_command(sub, _engine_args, engine_options)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
