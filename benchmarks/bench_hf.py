"""HF transformers baseline: static batching `model.generate` on the random workload.

Same prompts and lengths as the `random` workload of bench_serving (ignore_eos: every
sequence gets exactly output_len tokens, via min_new_tokens). Reports output tok/s.

    python -m benchmarks.bench_hf --size smoke --device cpu          # the tiny model
    python -m benchmarks.bench_hf --model DIR --random-weights --device cuda \\
        --dtype bfloat16 --batch-size 128 --max-batches 1             # dummy Llama-3-8B
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import torch

from benchmarks.workloads import make_workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: the tiny model)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights from config.json alone (dummy dirs)")  # fmt: skip
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--size", default="full", choices=["full", "smoke"])
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=int, default=None, help="override the workload's")
    p.add_argument("--output-len", type=int, default=None, help="override the workload's")
    p.add_argument("--batch-size", type=int, default=None, help="default: every prompt at once")
    p.add_argument("--max-batches", type=int, default=None, help="run only the first N batches")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--tag", default="hf")
    return p.parse_args(argv)


def load_model(path: str, random_weights: bool, device: str, dtype: torch.dtype):
    """The HF causal LM of `path` on `device` in `dtype`; with `random_weights`, built from
    config.json alone (allocated on the device directly, HF's random init)."""
    import transformers

    if not random_weights:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        return model.to(device=device, dtype=dtype).eval()
    config = transformers.AutoConfig.from_pretrained(path)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(device=device, dtype=dtype).eval()


def generate(model, prompts: list[tuple[int, ...]], output_len: int, device: str) -> float:
    """Static batch: every prompt has the same length, so no padding. Returns seconds."""
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=output_len,
        min_new_tokens=output_len,  # ignore_eos
        do_sample=False,
        pad_token_id=0,
    )
    _sync(device)
    elapsed = time.perf_counter() - start
    assert out.shape == (len(prompts), ids.shape[1] + output_len), out.shape
    return elapsed


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.startswith("cuda") else "float32"
    model_dir = args.model
    if model_dir is None:
        from radixrt.model.tiny import ensure_tiny_model

        model_dir = ensure_tiny_model()
    from radixrt.config import ModelConfig

    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    overrides = {k: v for k, v in (("input_len", args.input_len),
                                   ("output_len", args.output_len)) if v is not None}  # fmt: skip
    w = make_workload("random", args.size, args.scale, args.seed, vocab, **overrides)
    prompts = [p.calls[0].input_ids for p in w.programs]
    input_len, output_len = w.params["input_len"], w.params["output_len"]
    bsz = args.batch_size or len(prompts)
    batches = [prompts[i : i + bsz] for i in range(0, len(prompts), bsz)][: args.max_batches]

    t0 = time.perf_counter()
    model = load_model(model_dir, args.random_weights, device, getattr(torch, dtype_name))
    load_s = time.perf_counter() - t0
    with torch.inference_mode():
        generate(model, [p[:16] for p in batches[0][:2]], 4, device)  # warm-up
        times = [generate(model, b, output_len, device) for b in batches]
    n_out = sum(len(b) for b in batches) * output_len
    result = {
        "backend": "hf-transformers",
        "model": model_dir,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "dtype": dtype_name,
        "num_prompts": sum(len(b) for b in batches),
        "batch_size": bsz,
        "input_len": input_len,
        "output_len": output_len,
        "duration_s": sum(times),
        "batch_durations_s": times,
        "output_throughput": n_out / sum(times),
        "load_s": load_s,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "command": shlex.join(["python", "-m", "benchmarks.bench_hf", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"HF transformers generate ({result['device']}, {dtype_name}): {result['num_prompts']} "
        f"prompts x {input_len} in / {output_len} out, batch {bsz}: "
        f"{result['output_throughput']:.1f} out tok/s ({sum(times):.1f} s); wrote {path}"
    )
    return result


if __name__ == "__main__":
    main()
