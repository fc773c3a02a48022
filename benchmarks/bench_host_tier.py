"""Host KV tier transfer bandwidth: write-back (device -> host) and load (host -> device) of
KV blocks through `HostKVPool` (the runner's path: batched gathers on a copy stream, pinned
host memory), for Llama-3-8B-shaped blocks by default.

    python -m benchmarks.bench_host_tier                        # CUDA, 8B shapes, 2048 blocks
    python -m benchmarks.bench_host_tier --device cpu --num-layers 4 --blocks 256   # smoke
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from radixrt.kv.host_pool import HostKVPool
from radixrt.kv.pool import KVPool
from radixrt.plan import SwapIn, SwapOut


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=2048, help="blocks moved each way per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shuffle", action="store_true", help="random (not consecutive) block ids")
    args = p.parse_args(argv)
    n = args.blocks
    pool = KVPool(args.num_layers, n + 1, args.block_size, args.num_kv_heads, args.head_dim,
                  torch.bfloat16, args.device)  # fmt: skip
    host = HostKVPool(n, pool)
    dev_ids, host_ids = list(range(n)), list(range(n))
    if args.shuffle:
        random.Random(0).shuffle(host_ids)
    outs = [SwapOut(d, h) for d, h in zip(dev_ids, host_ids)]
    ins = [SwapIn(h, d) for d, h in zip(dev_ids, host_ids)]
    sync = torch.cuda.synchronize if pool.kv.is_cuda else (lambda: None)
    res = {"GB_per_direction": n * host.bytes_per_block / 1e9, "write_back_GBps": [],
           "load_GBps": []}  # fmt: skip
    for _ in range(args.rounds):
        for ops, key in ((outs, "write_back_GBps"), (ins, "load_GBps")):
            sync()
            t = time.perf_counter()
            touched = set() if key == "write_back_GBps" else set(dev_ids)
            host.execute(ops, touched, set())
            if pool.kv.is_cuda:
                host.wait_previous()
            sync()
            res[key].append(n * host.bytes_per_block / 1e9 / (time.perf_counter() - t))
    print(json.dumps({k: (max(v) if isinstance(v, list) else v) for k, v in res.items()}))


if __name__ == "__main__":
    main()
