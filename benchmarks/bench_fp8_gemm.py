"""FP8 (e4m3) scaled matmul against the bf16 GEMM on a model's linear shapes (CUDA, sm >= 8.9).

For each M (rows: decode batch sizes by default) and each linear of the model shape, the
median time per call inside a CUDA graph of `--reps` back-to-back calls (decode runs in
graphs; eager timings at small M measure launches, not kernels):
- `bf16`: `x @ w.t()`;
- `fp8 tensor`: `torch._scaled_mm` with one scale for the activations and one for the weight
  (activations already in e4m3: the GEMM alone);
- `fp8 row`: `torch._scaled_mm` with per-row activation scales [M, 1] and per-output-channel
  weight scales [1, N] (the GEMM alone);
- `fp8 row + torch quant`: the same, with the activations quantized per row by plain torch ops
  (absmax, divide, cast: what a fused quantization kernel must beat).
`per step` sums 32 layers (qkv, o, gate_up, down) plus one lm_head per M. Writes
<out>/fp8_gemm.json with every timing; prints the tables last.

    python -m benchmarks.bench_fp8_gemm                        # Llama-3-8B shapes, M = 1/32/256
    python -m benchmarks.bench_fp8_gemm --shape llama-3-8b --m 1 32 256 4096
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch

from radixrt.model.presets import PRESETS

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
LAYER_LINEARS = ("qkv", "o", "gate_up", "down")


def linear_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """name -> (in_features K, out_features N) of a preset's linears (one rank)."""
    c = PRESETS[preset]
    hidden = c["hidden_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q = c["num_attention_heads"] * head_dim
    kv = c["num_key_value_heads"] * head_dim
    return {
        "qkv": (hidden, q + 2 * kv),
        "o": (q, hidden),
        "gate_up": (hidden, 2 * c["intermediate_size"]),
        "down": (c["intermediate_size"], hidden),
        "lm_head": (hidden, c["vocab_size"]),
    }


def graph_ms(fn: Callable[[], object], reps: int, iters: int) -> float:
    """Median ms per `fn()` call, timed as a CUDA graph of `reps` back-to-back calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / reps)
    times.sort()
    return times[len(times) // 2]


def time_linear(m: int, k: int, n: int, reps: int, iters: int) -> dict[str, float]:
    """ms per call of each variant for one [m, k] x [k, n] product; also the relative error
    of each FP8 variant's output against the bf16 one (random normal activations)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    w_scale_row = (w.abs().amax(1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [N, 1]
    w_row = (w.float() / w_scale_row).to(FP8)
    w_scale_tensor = (w.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    w_tensor = (w.float() / w_scale_tensor).to(FP8)
    x_scale_row = (x.abs().amax(1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [M, 1]
    x_row = (x.float() / x_scale_row).to(FP8)
    x_scale_tensor = (x.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    x_tensor = (x.float() / x_scale_tensor).to(FP8)
    b_row = w_scale_row.t().contiguous()  # [1, N]

    def bf16() -> torch.Tensor:
        return x @ w.t()

    def fp8_tensor() -> torch.Tensor:
        return torch._scaled_mm(
            x_tensor,
            w_tensor.t(),
            scale_a=x_scale_tensor,
            scale_b=w_scale_tensor,
            out_dtype=torch.bfloat16,
        )

    def fp8_row() -> torch.Tensor:
        return torch._scaled_mm(
            x_row, w_row.t(), scale_a=x_scale_row, scale_b=b_row, out_dtype=torch.bfloat16
        )

    def fp8_row_torch_quant() -> torch.Tensor:
        scale = (x.abs().amax(1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (x.float() / scale).to(FP8)
        return torch._scaled_mm(
            xq, w_row.t(), scale_a=scale, scale_b=b_row, out_dtype=torch.bfloat16
        )

    ref = bf16().float()
    out = {"bf16": graph_ms(bf16, reps, iters)}
    for name, fn in (
        ("fp8_tensor", fp8_tensor),
        ("fp8_row", fp8_row),
        ("fp8_row_torch_quant", fp8_row_torch_quant),
    ):
        out[name] = graph_ms(fn, reps, iters)
        out[f"{name}_rel_err"] = float((fn().float() - ref).norm() / ref.norm())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(PRESETS))
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's layer count")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm needs a CUDA GPU (compute capability >= 8.9)")
    torch.manual_seed(0)
    shapes = linear_shapes(args.shape)
    layers = args.layers or PRESETS[args.shape]["num_hidden_layers"]
    variants = ("bf16", "fp8_tensor", "fp8_row", "fp8_row_torch_quant")
    rows, steps = [], []
    for m in args.m:
        step = dict.fromkeys(variants, 0.0)
        for name, (k, n) in shapes.items():
            t = time_linear(m, k, n, args.reps, args.iters)
            rows.append({"m": m, "linear": name, "k": k, "n": n, **t})
            for v in variants:
                step[v] += t[v] * (layers if name in LAYER_LINEARS else 1)
        steps.append({"m": m, "layers": layers, **step})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_gemm.json"), "w") as f:
        json.dump(
            {
                "shape": args.shape,
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "linears": rows,
                "per_step": steps,
            },
            f,
            indent=1,
        )
    print("| M | linear | bf16 ms | fp8 tensor | fp8 row | fp8 row + torch quant | rel err (row) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['m']} | {r['linear']} | {r['bf16']:.4f} | {r['fp8_tensor']:.4f} | "
            f"{r['fp8_row']:.4f} | {r['fp8_row_torch_quant']:.4f} | {r['fp8_row_rel_err']:.4f} |"
        )
    print(f"\nper decode step ({layers} layers + lm_head), ms:")
    print("| M | bf16 | fp8 tensor | fp8 row | fp8 row + torch quant |")
    print("|---|---|---|---|---|")
    for s in steps:
        print(
            f"| {s['m']} | {s['bf16']:.2f} | {s['fp8_tensor']:.2f} | {s['fp8_row']:.2f} | "
            f"{s['fp8_row_torch_quant']:.2f} |"
        )


if __name__ == "__main__":
    main()
