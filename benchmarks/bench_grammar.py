"""Structured output: per-step mask overhead and the jump-forward saving.

Part `masks`: B matchers of a tool-call JSON schema, each in a different state; per step, the
host builds every row's token bitmask (xgrammar fill + pack, what the scheduler does in
`_plan_row`) and the runner applies them to [B, V] logits (H2D + xgrammar's kernel on CUDA,
its CPU path on CPU); next to the sampler's own time on the same logits. `--vocab synthetic`
uses a 128256-token byte vocabulary (Llama-3's size; random pieces) so that fill cost is that
of a large vocabulary even with the tiny tokenizer of the dummy checkpoints.

Part `jump-forward`: a JSON-heavy agent workload (every call a tool call under a schema,
seeded sampling) on an in-process Engine with jump-forward off, token-level (the default:
outputs must be identical to off) and string-level (`jump_forward_retokenize`: forced strings
as xgrammar tokenizes them; valid but not identical): steps, generated and forced tokens,
tokens/s.

    python -m benchmarks.bench_grammar                       # tiny, CPU
    python -m benchmarks.bench_grammar --preset llama-3-8b --device cuda \
        --vocab synthetic --batch-sizes 32,256 --num-requests 256 --json grammar.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import tempfile
import time
from functools import partial

import torch

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "thought": {"type": "string", "maxLength": 48},
        "tool": {"enum": ["search_web", "read_file", "write_file", "run_python"]},
        "arguments": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 32},
                "max_results": {"enum": [1, 5, 10]},
                "safe_search": {"type": "boolean"},
            },
            "required": ["query", "max_results", "safe_search"],
            "additionalProperties": False,
        },
        "final_answer": {"type": "boolean"},
    },
    "required": ["thought", "tool", "arguments", "final_answer"],
    "additionalProperties": False,
}
EXAMPLE = (
    '{"thought": "look it up", "tool": "search_web", "arguments": {"query": "weather in Paris",'
    ' "max_results": 5, "safe_search": true}, "final_answer": false}'
)
TASKS = [
    "find flights",
    "summarise the report",
    "plot the sales",
    "check the weather",
    "read config.yaml",
    "fix the failing test",
    "translate the page",
    "book a table",
]
# fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device, iters: int) -> float:
    times = []
    for _ in range(iters):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _synthetic_backend(vocab_size: int, eos: list[int], mask_threads: int, spec):
    """An XGrammarBackend (for its matchers) and `spec` compiled here against a random
    vocabulary of `vocab_size` tokens shaped like a BPE one (mostly word pieces, some
    punctuation runs): (backend, Compiled, compile seconds)."""
    import xgrammar as xgr

    from radixrt.grammar.xgrammar_backend import Compiled, XGrammarBackend

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz" * 3 + "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"
    punct = "\"':,.;{}[]()-_/"
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    seen = set(vocab)
    while len(vocab) < vocab_size - len(eos):
        r = rng.random()
        if r < 0.9:  # words and word pieces, often with a leading space (as BPE vocabularies)
            piece = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            piece = (" " if rng.random() < 0.5 else "") + piece
        else:  # punctuation runs, some glued to a word piece
            piece = "".join(rng.choice(punct) for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.5:
                piece += "".join(rng.choice(letters) for _ in range(rng.randint(1, 4)))
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    vocab += [f"<eos{i}>" for i in range(len(eos))]
    stops = list(range(vocab_size - len(eos), vocab_size))
    backend = XGrammarBackend("", vocab_size, stops, mask_threads=mask_threads)
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    t = time.perf_counter()
    grammar = xgr.GrammarCompiler(info, max_threads=8).compile_json_schema(
        spec.text, any_whitespace=False
    )
    return backend, Compiled(grammar), time.perf_counter() - t


def bench_masks(args, model_dir: str, vocab_size: int, eos: list[int]) -> list[dict]:
    from radixrt.executor.grammar_masks import apply_token_bitmasks
    from radixrt.executor.sampler import sample
    from radixrt.grammar.spec import GrammarSpec
    from radixrt.grammar.xgrammar_backend import XGrammarBackend
    from radixrt.sampling import SamplingParams

    device = torch.device(args.device)
    spec = GrammarSpec("json_schema", json.dumps(TOOL_SCHEMA))
    if args.vocab == "synthetic":
        backend, grammar, compile_s = _synthetic_backend(
            args.synthetic_vocab, eos, args.mask_threads, spec
        )
        vocab_size = args.synthetic_vocab
    else:
        backend = XGrammarBackend(model_dir, vocab_size, eos, mask_threads=args.mask_threads)
        t = time.perf_counter()
        outcome = backend.poll(backend.submit(spec))
        while outcome is None:
            time.sleep(0.01)
            outcome = backend.poll(backend.submit(spec))
        compile_s = time.perf_counter() - t  # with the compile workers' start-up
        grammar = outcome.grammar
    rows = []
    for b in args.batch_sizes:
        rng = random.Random(b)
        matchers = []
        for _ in range(b):
            m = backend.new_matcher(grammar)
            assert m._matcher.accept_string(EXAMPLE[: rng.randint(0, len(EXAMPLE) - 1)])
            matchers.append(m)

        def build(matchers=matchers):
            masks = []
            for m in matchers:
                m._fresh = False  # the state changed (a token was accepted)
                masks.append(m.next_mask())
            return masks

        def build_batched(matchers=matchers):
            for m in matchers:
                m._fresh = False
            backend.fill_masks(matchers)  # what the scheduler does before planning rows
            return [m.next_mask() for m in matchers]

        masks = build()
        assert build_batched() == masks
        logits = torch.randn(b, vocab_size, device=device)
        params = [SamplingParams(temperature=0.8, top_p=0.95)] * b
        offsets = [0] * b
        work = logits.clone()
        index = list(range(b))
        build_ms = _median_ms(build, device, args.iters)
        build_batched_ms = _median_ms(build_batched, device, args.iters)
        half = index[::2]  # mixed batch: every other row constrained (gather / scatter path)
        apply_ms = _median_ms(partial(apply_token_bitmasks, work, masks, index), device, args.iters)
        apply_half_ms = _median_ms(
            partial(apply_token_bitmasks, work, masks[::2], half), device, args.iters
        )
        sample_ms = _median_ms(partial(sample, logits, params, offsets), device, args.iters)
        rows.append(
            {
                "part": "masks",
                "batch_size": b,
                "vocab_size": vocab_size,
                "vocab": args.vocab,
                "device": args.device,
                "compile_s": compile_s,
                "mask_build_ms": build_ms,
                "mask_build_batched_ms": build_batched_ms,
                "mask_threads": backend.mask_threads,
                "mask_apply_ms": apply_ms,
                "mask_apply_half_rows_ms": apply_half_ms,
                "sampler_ms": sample_ms,
                "mask_overhead_ms": min(build_ms, build_batched_ms) + apply_ms,
            }
        )
        print(json.dumps(rows[-1]))
    backend.close()
    return rows


def bench_jump_forward(args, model_dir: str, options: dict) -> list[dict]:
    from radixrt import Engine, SamplingParams

    prefix = "You are an agent. Answer every request with one tool call as JSON.\nExample: "
    prompts = [
        f"{prefix}{EXAMPLE}\nRequest {i}: {TASKS[i % len(TASKS)]}\nCall: "
        for i in range(args.num_requests)
    ]
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i, json_schema=TOOL_SCHEMA)
        for i in range(args.num_requests)
    ]
    rows, outputs = [], {}
    modes = {
        "off": {"jump_forward": False},
        "token": {},
        "string": {"jump_forward_retokenize": True},
    }
    for mode, extra in modes.items():
        if mode not in args.modes:
            continue
        engine = Engine(model_dir, **extra, **options)
        engine.generate(prompts[:2], params[:2])  # warm-up (and the grammar compile)
        before = engine.stats()
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - t
        after = engine.stats()
        engine.check_integrity()
        outputs[mode] = [o.token_ids for o in outs]
        gen = after["generated_tokens"] - before["generated_tokens"]
        row = {
            "part": "jump-forward",
            "jump_forward": mode,  # off | token (output-identical) | string (retokenized)
            "num_requests": args.num_requests,
            "steps": after["steps"] - before["steps"],
            "generated_tokens": gen,
            "forced_tokens": after["grammar_forced_tokens"] - before["grammar_forced_tokens"],
            "finished_stop": sum(o.finish_reason.value == "stop" for o in outs),
            "wall_s": wall,
            "tokens_per_s": gen / wall,
        }
        rows.append(row)
        print(json.dumps(row))
        engine.shutdown()
        del engine  # the next mode's engine needs the device memory
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "off" in outputs and "token" in outputs:
        same = sum(a == b for a, b in zip(outputs["off"], outputs["token"]))
        print(f"jump-forward token vs off: {same}/{len(outputs['off'])} outputs identical")
        if args.device == "cpu":  # exact in float32; bf16 batches differ (near ties flip)
            assert same == len(outputs["off"]), "token-level jump-forward changed the outputs"
        for row in rows:
            row["identical_to_off"] = same
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="masks,jump-forward")
    p.add_argument("--model", default=None, help="model dir (default: the tiny model)")
    p.add_argument("--preset", default=None, help="a dummy preset instead (e.g. llama-3-8b)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", choices=("model", "synthetic"), default="model")
    p.add_argument("--synthetic-vocab", type=int, default=128256)
    p.add_argument("--batch-sizes", default="32,256")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--mask-threads", type=int, default=4, help="batched mask fill threads")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--modes", default="off,token,string", help="jump-forward modes to run")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument(
        "--dtype", default=None, help="engine dtype (default: float32 on CPU, bf16 on CUDA)"
    )
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size (default: auto)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    options: dict = {"device": args.device}
    options["dtype"] = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.num_kv_blocks is not None:
        options["num_kv_blocks"] = args.num_kv_blocks
    if args.preset is not None:
        from radixrt.model.presets import write_dummy_model_dir

        model_dir = write_dummy_model_dir(
            os.path.join(tempfile.mkdtemp(), args.preset), args.preset
        )
        options["load_format"] = "dummy"
    elif args.model is not None:
        model_dir = args.model
    else:
        from radixrt.model.tiny import ensure_tiny_model

        model_dir = ensure_tiny_model()
    if args.device == "cpu":
        options["cpu_threads"] = args.threads
    from radixrt.config import ModelConfig

    mc = ModelConfig.from_pretrained(model_dir)
    rows: list[dict] = []
    parts = args.parts.split(",")
    if "masks" in parts:
        rows += bench_masks(args, model_dir, mc.vocab_size, list(mc.eos_token_ids))
    if "jump-forward" in parts:
        rows += bench_jump_forward(args, model_dir, options)
    if args.json:
        meta = {"host": platform.node(), "device": args.device, "model": args.preset or model_dir}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
