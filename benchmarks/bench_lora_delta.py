"""The LoRA delta of one decoder layer (qkv, o, gate_up, down) on a model shape (CUDA, bf16):
the segmented Triton kernels (radixrt.kernels.lora) against the masked torch path (one GEMM
over every slot in use) and against the layer's base GEMMs, for a batch whose rows use 1, 8
or 32 adapters (rank 16 and 64). Rows are spread over the adapters round-robin; each row is
one decode token (`--decode-rows`) or a prefill segment (`--prefill`). Eager timing with CUDA
events, median of `--iters` (launch overheads included, which a decode CUDA graph's replay
saves). Prints a table; --json writes it.

    python -m benchmarks.bench_lora_delta                      # Llama-3-8B shape
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from radixrt.kernels.lora import build_lora_segments
from radixrt.lora.batch import LayerLora, MaskedLoraBatch, SegmentedLoraBatch
from radixrt.model.presets import PRESETS

PARTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def layer_shapes(preset: str) -> dict[str, tuple[int, list[int]]]:
    """merged projection -> (in features, out features of each part)."""
    c = PRESETS[preset]
    h, i = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {
        "qkv_proj": (h, [q, kv, kv]),
        "o_proj": (q, [h]),
        "gate_up_proj": (h, [i, i]),
        "down_proj": (i, [h]),
    }


def make_layer(shapes, slots: int, rank: int) -> dict[str, LayerLora]:
    layer = {}
    for name, (fan_in, outs) in shapes.items():
        P = len(outs)
        starts = np.cumsum([0, *outs]).tolist()
        layer[name] = LayerLora(
            torch.randn(fan_in, slots * P * rank, device="cuda", dtype=torch.bfloat16) * 0.01,
            [
                torch.randn(slots * rank, n, device="cuda", dtype=torch.bfloat16) * 0.01
                for n in outs
            ],
            [(starts[p], starts[p + 1]) for p in range(P)],
        )
    return layer


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--decode-rows", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--prefill", type=int, nargs=2, default=[8, 512], metavar=("ROWS", "TOKENS"))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = layer_shapes(args.shape)
    weights = {
        name: torch.randn(sum(outs), fan_in, device="cuda", dtype=torch.bfloat16) * 0.01
        for name, (fan_in, outs) in shapes.items()
    }
    batches = [(f"decode {n}", np.ones(n, dtype=np.int64)) for n in args.decode_rows]
    rows, tokens = args.prefill
    batches.append((f"prefill {rows}x{tokens}", np.full(rows, tokens, dtype=np.int64)))
    results = []
    for rank in args.ranks:
        slots = max(args.adapters)
        layer = make_layer(shapes, slots, rank)
        for label, num_new in batches:
            T = int(num_new.sum())
            xs = {
                n: torch.randn(T, f, device="cuda", dtype=torch.bfloat16)
                for n, (f, _) in shapes.items()
            }

            def base(xs=xs):
                return [xs[n] @ weights[n].t() for n in PARTS]

            base_ms = time_ms(base, args.iters)
            outs = base()
            for n_adapters in args.adapters:
                row_slot = np.arange(len(num_new)) % n_adapters
                token_slot = np.repeat(row_slot, num_new)
                used = int(row_slot.max()) + 1
                mask = torch.zeros(T, used, dtype=torch.bfloat16)
                mask[torch.arange(T), torch.from_numpy(token_slot)] = 1
                masked = MaskedLoraBatch([layer], mask.cuda(), used, rank)
                seg = SegmentedLoraBatch(
                    [layer],
                    build_lora_segments(torch.from_numpy(token_slot), torch.device("cuda")),
                    rank,
                )
                row = {"rank": rank, "batch": label, "adapters": n_adapters, "base_ms": base_ms}
                for name, b in (("masked_ms", masked), ("segmented_ms", seg)):
                    row[name] = time_ms(
                        lambda b=b, xs=xs, outs=outs: [
                            b.apply(outs[i], xs[n], 0, n) for i, n in enumerate(PARTS)
                        ],
                        args.iters,
                    )
                results.append(row)
                print(
                    f"r={rank:<3} {label:<16} adapters={n_adapters:<3} base {base_ms:.3f} ms  "
                    f"masked {row['masked_ms']:.3f} ms  segmented {row['segmented_ms']:.3f} ms",
                    flush=True,
                )
    print(f"\n{torch.cuda.get_device_name()}, {args.shape}, bf16, one layer's 4 projections")
    print("| rank | batch | adapters | base GEMMs ms | masked torch ms | segmented Triton ms |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['rank']} | {r['batch']} | {r['adapters']} | {r['base_ms']:.3f} | "
            f"{r['masked_ms']:.3f} | {r['segmented_ms']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
