"""Per-step communication cost of tensor parallelism, 2 ranks on one host.

- plan transport: a step plan encoded (`PlanEncoder`), broadcast on the gloo control group
  and decoded on rank 1 (`PlanDecoder`): decode plans of B = 1, 32, 256 rows (one token;
  sampling parameters travel in slot entries once per request, none in the steady state)
  and a mixed plan (32 decode rows + one 2048-token prefill chunk). Rank 0: encode and send
  time; rank 1: time per plan over a back-to-back stream (receive + decode).
- model collectives (`TPGroup.all_reduce`, `all_gather_last`) at Llama-3-8B sizes: the
  all-reduce of [T, 4096] hidden states (65 per step: 2 per layer + the embedding) and the
  all-gather of [B, 128256 / 2] logits. gloo on --device cpu, NCCL on --device cuda.
Medians of `--iters` runs after warm-up. CPU numbers are gloo over loopback TCP: a bound
on the CPU path, not a prediction for NVLink.

    python -m benchmarks.bench_tp_comm [--device cpu|cuda] [--iters 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HIDDEN = 4096  # Llama-3-8B
VOCAB = 128256
LAYERS = 32


def plans():
    from radixrt.plan import PlanRow, StepPlan

    def decode_rows(n):
        return [
            PlanRow(
                rid=f"req-{i}-0123abcd",
                slot=i,
                start=1000 + i,
                num_tokens=1,
                input_ids=[],
                reads_last_sample=True,
                table_start=(1000 + i) // 16,
                new_blocks=[i] if i % 16 == 0 else [],
                sample_offsets=[0],
                num_output_before=10,
            )
            for i in range(n)
        ]

    prefill = PlanRow(
        rid="prefill",
        slot=255,
        start=0,
        num_tokens=2048,
        input_ids=list(range(2048)),
        new_blocks=list(range(128)),
        sample_offsets=[2047],
    )
    return {
        "decode B=1": StepPlan(1, decode_rows(1)),
        "decode B=32": StepPlan(2, decode_rows(32)),
        "decode B=256": StepPlan(3, decode_rows(256)),
        "32 decode + 2048 prefill": StepPlan(4, decode_rows(32) + [prefill]),
    }


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def run_rank(rank: int, port: int, device: str, iters: int) -> None:
    import torch

    from radixrt.executor.tp.plan_codec import PlanDecoder, PlanEncoder
    from radixrt.executor.tp.runner import PLAN_CAPACITY
    from radixrt.model.tp.group import TPGroup, connect_store, create_store

    torch.set_num_threads(1)
    store = create_store(2) if rank == 0 else connect_store(port, 2)
    if rank == 0:
        child = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                "1",
                "--port",
                str(store.port),
                "--device",
                device,
                "--iters",
                str(iters),
            ]  # fmt: skip
        )
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group = TPGroup(rank, 2, dev, store)
    rows = []
    encoder, decoder = PlanEncoder(), PlanDecoder()
    for name, plan in plans().items():
        # The first send warms up; not timed.
        first = group.broadcast_bytes(encoder.encode(plan) if rank == 0 else None, PLAN_CAPACITY)
        if rank:
            decoder.decode(first)
        enc, send, recv = [], [], []
        group.min_int(0)  # line up
        for _ in range(iters):
            if rank == 0:
                t0 = time.perf_counter()
                data = encoder.encode(plan)
                t1 = time.perf_counter()
                group.broadcast_bytes(data, PLAN_CAPACITY)
                enc.append(t1 - t0)
                send.append(time.perf_counter() - t1)
            else:
                t0 = time.perf_counter()
                decoder.decode(group.broadcast_bytes(None, PLAN_CAPACITY))
                recv.append(time.perf_counter() - t0)
        theirs = group.gather_host(torch.tensor([median_us(recv) if rank else 0.0]))
        if rank == 0:
            size = len(encoder.encode(plan))
            rows.append((name, size, median_us(enc), median_us(send), float(theirs[1])))
    dtypes = [torch.float32, torch.bfloat16] if dev.type == "cpu" else [torch.bfloat16]
    coll = []
    for dtype in dtypes:
        for t in (1, 32, 256, 2048):
            x = torch.randn(t, HIDDEN, device=dev).to(dtype)
            coll.append((f"all_reduce [{t}, {HIDDEN}] {dtype}".replace("torch.", ""),
                         time_op(lambda x=x: group.all_reduce(x), dev, iters)))  # fmt: skip
        for b in (1, 32):
            x = torch.randn(b, VOCAB // 2, device=dev).to(dtype)
            coll.append((f"all_gather [{b}, {VOCAB // 2}] {dtype}".replace("torch.", ""),
                         time_op(lambda x=x: group.all_gather_last(x), dev, iters)))  # fmt: skip
    if rank == 0:
        backend = "NCCL" if dev.type == "cuda" else "gloo (CPU, loopback TCP, 1 thread/rank)"
        print(f"\nplan transport (gloo control group), median of {iters}")
        print(
            f"{'plan':28} {'bytes':>7} {'encode us':>10} {'send us':>9} {'rank1 recv+dec us':>18}"
        )
        for name, size, e, s, r in rows:
            print(f"{name:28} {size:7d} {e:10.0f} {s:9.0f} {r:18.0f}")
        print(f"\nmodel collectives ({backend}), median of {iters}")
        for name, us in coll:
            extra = ""
            if name.startswith("all_reduce"):
                extra = f"  x{2 * LAYERS + 1} per step = {us * (2 * LAYERS + 1) / 1000:.1f} ms"
            print(f"{name:44} {us:9.0f} us{extra}")
    group.close()
    if rank == 0:
        child.wait()


def time_op(fn, dev, iters: int) -> float:
    import torch

    for _ in range(5):
        fn()
    samples = []
    for _ in range(iters):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return median_us(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from radixrt.model.tp.group import set_nccl_env

    set_nccl_env()
    os.environ.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(__file__)))
    run_rank(args.rank, args.port, args.device, args.iters)


if __name__ == "__main__":
    main()
