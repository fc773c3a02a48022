"""`radixrt` command line: demo, make-tiny-model, generate, serve, options-table."""

from __future__ import annotations

import argparse
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that builds an engine: one flag per option declared in
    radixrt.config (radixrt.options)."""
    from radixrt.config import EngineConfig  # torch-free
    from radixrt.options import add_flags

    g = p.add_argument_group("model")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="GGUF models: an HF dir whose tokenizer and chat template replace the file's own",
    )
    g.add_argument("--revision", default=None, help="hub ids: the branch, tag or commit")
    add_flags(p, EngineConfig)


def engine_options(args: argparse.Namespace) -> dict:
    """Engine keyword arguments of the engine flags given (`_engine_args`)."""
    from radixrt.config import EngineConfig
    from radixrt.options import given_options

    return given_options(args, EngineConfig)


def cmd_options_table(args: argparse.Namespace) -> None:
    from radixrt.config import EngineConfig
    from radixrt.options import write_doc_table

    changed = write_doc_table(args.path, EngineConfig)
    print(f"{args.path}: {'updated' if changed else 'current'}")


def cmd_make_tiny_model(args: argparse.Namespace) -> None:
    from radixrt.model.tiny import make_tiny_model

    print(make_tiny_model(args.dir, seed=args.seed, random=args.random))


def cmd_demo(args: argparse.Namespace) -> None:
    """The runtime's features on SmolLM2, or the tiny model (radixrt.demo)."""
    from radixrt import Engine
    from radixrt.demo import DEMO_KV_BLOCKS, run_demo
    from radixrt.hf_dir.smollm2 import SMOLLM2_LINE, fetch_default_model
    from radixrt.model.tiny import TINY_MODEL_LINE, ensure_tiny_model, tiny_model_ready

    model, line = args.model, args.model
    default = model is None and not args.tiny and (model := fetch_default_model()) is not None
    if default:
        line = f"{SMOLLM2_LINE} ({model})"
    if model is None:
        if not tiny_model_ready():
            print("training the tiny model on first use (1-2 minutes on one core)...", flush=True)
        model = ensure_tiny_model()
        line = f"the tiny model, {TINY_MODEL_LINE} ({model})"
    options = engine_options(args)
    options.setdefault("num_kv_blocks", DEMO_KV_BLOCKS)
    options.setdefault("cpu_prepack_weights", False)  # the demo's memory over its speed
    engine = Engine(model, tokenizer=args.tokenizer, revision=args.revision, **options)
    try:
        checks = run_demo(engine, args.max_tokens, line, check_fact=default)
    finally:
        engine.shutdown()
    if not all(checks.values()):
        sys.exit(1)


def cmd_generate(args: argparse.Namespace) -> None:
    from radixrt import Engine, SamplingParams

    engine = Engine(
        args.model, tokenizer=args.tokenizer, revision=args.revision, **engine_options(args)
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for delta in engine.generate_stream([args.prompt], params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    print()
    engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run a short demo on a real model (CPU is fine)")
    p.add_argument(
        "--model",
        default=None,
        help="an HF dir, a .gguf file or a hub id (default: SmolLM2-135M-Instruct, fetched "
        "once, ~100 MB; the tiny model if that fails)",
    )
    p.add_argument("--tiny", action="store_true", help="the embedded tiny model (trained once)")
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

    p = sub.add_parser("options-table", help="rewrite the engine option table of docs/api.md")
    p.add_argument("path", nargs="?", default="docs/api.md")
    p.set_defaults(func=cmd_options_table)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
