"""FP8 (W8A8) linear layers against the unquantized model: accuracy, GEMM error, memory.

- accuracy (`--model`, default the trained tiny model): the held-out prose
  (tests/data/heldout_prose.txt), teacher-forced. Per position: top-1 agreement (the greedy
  next token of each prefix, fp8 vs reference) and |delta log-prob| of the true next token
  (prompt log-probs). Configurations: `quantization="fp8"` at load for each
  `--modes` (token, tensor), and each `--checkpoint` dir (an fp8 checkpoint of the same
  model, e.g. written by llm-compressor).
- `--gemm`: per-GEMM relative error ||y - y_ref|| / ||y_ref|| of each Llama-3-8B linear
  shape (random weights as dummy weights are, uniform +-0.02; activations N(0, 1) with a
  few outlier channels), fp8 layer vs the float32 product of the same bf16 inputs. On random
  weights greedy agreement means nothing, so this is the dummy 8B shape's accuracy figure.
- `--memory` (CUDA): weight GiB and KV blocks of the dummy Llama-3-8B, bf16 vs fp8 (the KV
  pool is sized from measured free memory after loading, so it gains what fp8 frees).

    python -m benchmarks.bench_fp8_weights                         # CPU, tiny model
    python -m benchmarks.bench_fp8_weights --device cuda --dtype bfloat16 --gemm --memory
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass

HELDOUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "heldout_prose.txt")
LLAMA3_8B_LINEARS = {  # name -> (in, out) of one layer's (merged) linears
    "qkv_proj": (4096, 6144),
    "o_proj": (4096, 4096),
    "gate_up_proj": (4096, 28672),
    "down_proj": (14336, 4096),
}


@dataclass(frozen=True)
class TeacherForced:
    top1: list[int]  # greedy next token after each prefix ids[:i], i = 1..n-1, all texts
    logprobs: list[float]  # log p(ids[i] | ids[:i]) at the same positions


@dataclass(frozen=True)
class Agreement:
    top1_agreement: float  # share of positions whose greedy next token is the reference's
    mean_abs_dlogprob: float  # mean |log p - log p_ref| of the true next token
    max_abs_dlogprob: float
    num_positions: int


def heldout_texts(tokenizer, max_tokens: int = 160) -> list[list[int]]:
    """The held-out paragraphs as token ids (each cut to `max_tokens`)."""
    with open(HELDOUT, encoding="utf-8") as f:
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", f.read()) if p.strip()]
    return [tokenizer.encode(p)[:max_tokens] for p in paragraphs]


def teacher_forced(engine, texts: list[list[int]]) -> TeacherForced:
    """Scores every next-token position of `texts` with `engine` (prefixes share KV through
    the prefix cache)."""
    from radixrt import SamplingParams

    prefixes = [ids[:i] for ids in texts for i in range(1, len(ids))]
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    top1 = [o.token_ids[0] for o in engine.generate(prompt_token_ids=prefixes,
                                                    sampling_params=greedy)]  # fmt: skip
    scored = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=True)
    logprobs = []
    for out in engine.generate(prompt_token_ids=texts, sampling_params=scored):
        logprobs += list(out.prompt_logprobs)
    assert len(logprobs) == len(top1)
    return TeacherForced(top1, logprobs)


def agreement(ref: TeacherForced, got: TeacherForced) -> Agreement:
    same = sum(a == b for a, b in zip(ref.top1, got.top1))
    diffs = [abs(a - b) for a, b in zip(ref.logprobs, got.logprobs)]
    return Agreement(same / len(ref.top1), sum(diffs) / len(diffs), max(diffs), len(diffs))


def accuracy(args) -> list[dict]:
    from radixrt import Engine
    from radixrt.hf_dir import load_tokenizer

    texts = heldout_texts(load_tokenizer(args.model))
    opts = dict(device=args.device, dtype=args.dtype, block_size=4)

    def score(path: str, **kw) -> TeacherForced:
        engine = Engine(path, **opts, **kw)
        try:
            return teacher_forced(engine, texts)
        finally:
            engine.shutdown()

    ref = score(args.model)
    runs = [(f"quantization=fp8 {m}", args.model, dict(quantization="fp8",
             fp8_activation_scale=m)) for m in args.modes.split(",") if m]  # fmt: skip
    runs += [(f"checkpoint {os.path.basename(c.rstrip('/'))}", c, {}) for c in args.checkpoint]
    rows = []
    for name, path, kw in runs:
        row = {"config": name, **asdict(agreement(ref, score(path, **kw)))}
        rows.append(row)
        print(row)
    return rows


def gemm_errors(device: str, dtype: str, modes: list[str], rows: int = 32) -> list[dict]:
    """Per-GEMM relative error of Fp8Linear on the Llama-3-8B linear shapes."""
    import torch

    from radixrt.model import DTYPES
    from radixrt.model.fp8_linear import Fp8Linear
    from radixrt.quantization import resolve_scheme

    torch_dtype = DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for mode in modes:
        scheme = resolve_scheme(None, "fp8", mode)
        for name, (k, n) in LLAMA3_8B_LINEARS.items():
            w = torch.empty((n, k), device=device).uniform_(-0.02, 0.02, generator=gen)
            w = w.to(torch_dtype)
            x = torch.randn((rows, k), device=device, generator=gen)
            x[:, :4] *= 20.0  # a few outlier channels, as in real activations
            x = x.to(torch_dtype)
            previous = torch.get_default_dtype()
            torch.set_default_dtype(torch_dtype)
            try:
                with torch.device(device):
                    layer = Fp8Linear(k, n, scheme)
            finally:
                torch.set_default_dtype(previous)
            layer.load("weight", w, 0)
            layer.finish_loading(dequantize=not device.startswith("cuda"))
            with torch.no_grad():
                y = layer(x).float()
            ref = x.float() @ w.float().t()
            err = ((y - ref).norm() / ref.norm()).item()
            row = dict(mode=mode, linear=name, k=k, n=n, rows=rows, rel_error=err)
            out.append(row)
            print(row)
            del layer, w
    return out


def memory(args) -> list[dict]:
    """Weights and KV blocks of the dummy Llama-3-8B, bf16 vs fp8 (CUDA)."""
    import torch

    from radixrt import Engine
    from radixrt.model import weight_bytes
    from radixrt.model.presets import write_dummy_model_dir

    path = write_dummy_model_dir(os.path.join(tempfile.mkdtemp(), "llama-3-8b"), "llama-3-8b")
    rows = []
    for quantization in (None, "fp8"):
        engine = Engine(path, device="cuda", dtype="bfloat16", load_format="dummy",
                        quantization=quantization, max_model_len=8192)  # fmt: skip
        runner = engine.core.runner
        row = dict(
            quantization=quantization or "bf16",
            weights_gib=weight_bytes(runner.model) / 2**30,
            kv_blocks=runner.pool.num_blocks,
            kv_tokens=runner.pool.num_tokens,
            peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
        )
        rows.append(row)
        print(row)
        engine.shutdown()
        del engine, runner
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir (default: the trained tiny model)")
    p.add_argument("--checkpoint", action="append", default=[],
                   help="an fp8 checkpoint of --model to score as well (repeatable)")  # fmt: skip
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--modes", default="token,tensor", help="fp8_activation_scale values")
    p.add_argument("--no-accuracy", action="store_true")
    p.add_argument("--gemm", action="store_true", help="per-GEMM error on Llama-3-8B shapes")
    p.add_argument("--memory", action="store_true", help="weights / KV blocks, dummy 8B (CUDA)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.model is None:
        from radixrt.model.tiny import ensure_tiny_model

        args.model = ensure_tiny_model()
    results: dict[str, list[dict]] = {}
    if not args.no_accuracy:
        results["accuracy"] = accuracy(args)
    if args.gemm:
        modes = [m for m in args.modes.split(",") if m]
        results["gemm"] = gemm_errors(args.device, args.dtype, modes)
    if args.memory:
        results["memory"] = memory(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    for r in results.get("accuracy", []):
        print(f"| {r['config']} | {r['top1_agreement']:.4f} | {r['mean_abs_dlogprob']:.4f} | "
              f"{r['max_abs_dlogprob']:.3f} | {r['num_positions']} |")  # fmt: skip
    for r in results.get("gemm", []):
        print(f"| {r['mode']} | {r['linear']} | {r['k']}x{r['n']} | {r['rel_error']:.4f} |")


if __name__ == "__main__":
    main()
