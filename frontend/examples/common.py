"""Command-line options and backend creation shared by the examples."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from radixrt.frontend import Backend, Runtime, RuntimeEndpoint


def parse_args(
    description: str, argv: Sequence[str] | None, parser_hook=None
) -> argparse.Namespace:
    """--model/--url/--device/--max-tokens/--temperature plus what `parser_hook` adds."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="model dir (default: the tiny test model)")
    p.add_argument(
        "--url",
        default=None,
        help="use the `radixrt serve` server at this URL instead of an in-process engine "
        "(the tokenizer comes from --model if given, else from the server)",
    )
    p.add_argument("--device", default="auto", help="in-process engine device")
    p.add_argument("--max-tokens", type=int, default=32, help="max tokens per gen")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    if parser_hook is not None:
        parser_hook(p)
    return p.parse_args(argv)


def make_backend(args: argparse.Namespace) -> Backend:
    """A RuntimeEndpoint for --url, else an in-process Runtime (close it when done)."""
    if args.url:
        return RuntimeEndpoint(args.url, model_path=args.model)
    from radixrt.model.tiny import ensure_tiny_model

    return Runtime(args.model or ensure_tiny_model(), device=args.device)


def cache_report(backend: Backend) -> str:
    """Prefix-cache statistics of an in-process backend ("" for a server)."""
    engine = getattr(backend, "engine", None)
    if engine is None:
        return ""
    stats = engine.stats()
    return (
        f"prefix cache: {stats['cached_tokens']}/{stats['prompt_tokens']} prompt tokens "
        f"reused ({stats['cache_hit_rate']:.0%}) over {stats['num_requests']} requests"
    )
