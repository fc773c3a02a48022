"""CPU extend (prefill) attention, one layer: the native extend kernel vs the one-query-at-a-time
decode kernel vs torch SDPA on gathered K/V.

    python -m benchmarks.bench_cpu_extend [--threads 1] [--repeats 21]

Cases (float32, blocks of the pool scattered at random, the rows' new K/V already in it):
(a) 32 fresh rows x 128 tokens, tiny Llama heads (6 query / 2 kv heads x 32), block 16;
(b) 8 rows x 32 new tokens over 400 cached keys, same heads; (c) 4 fresh rows x 512, same
heads; (d) Llama-3-8B heads (32 / 8 x 128), 8 fresh rows x 128; (e) and (f): short extends
and decode rows (4 and 1 new tokens over 600 cached keys), where the decode kernel competes.
Columns, milliseconds a layer, median of `--repeats` interleaved repeats (each method once per
repeat, after a warm-up): `extend` (kernels/paged_extend_cpu), `decode`
(kernels/paged_decode_cpu, each new token a query with its causal kv_len), `sdpa` (gather the
rows' K/V from the pool, one batched torch scaled_dot_product_attention call: is_causal for
fresh rows, a boolean mask for prefixed ones; GQA by enable_gqa; the result copied into the
[tokens, heads, dim] output) and `sdpa-only` (the SDPA call alone on K/V gathered beforehand).
All methods are checked to agree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixrt.kernels.paged_decode_cpu import load_paged_decode
from radixrt.kernels.paged_extend_cpu import load_paged_extend


class Case(NamedTuple):
    name: str
    rows: int  # rows, all of one shape
    cached: int  # keys already in the pool before the new tokens
    new: int  # new tokens a row
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    block_size: int


CASES = [
    Case("(a) 32 x 128 fresh, 6/2 x 32", 32, 0, 128, 6, 2, 32, 16),
    Case("(b) 8 x 32 new on 400 cached, 6/2 x 32", 8, 400, 32, 6, 2, 32, 16),
    Case("(c) 4 x 512 fresh, 6/2 x 32", 4, 0, 512, 6, 2, 32, 16),
    Case("(d) 8 x 128 fresh, 32/8 x 128", 8, 0, 128, 32, 8, 128, 16),
    Case("(e) 32 x 4 new on 600 cached, 6/2 x 32", 32, 600, 4, 6, 2, 32, 16),
    Case("(f) 32 x 1 new on 600 cached, 6/2 x 32", 32, 600, 1, 6, 2, 32, 16),
]


class Inputs(NamedTuple):
    q: torch.Tensor  # [T, hq, d]
    k_cache: torch.Tensor  # [num_blocks, block_size, hkv, d]
    v_cache: torch.Tensor
    table: torch.Tensor  # [R, blocks a row] int64
    kv_indices: torch.Tensor  # [R * blocks a row] int32
    block_start: torch.Tensor  # [R] int64
    kv_len: torch.Tensor  # [R] int32
    q_start: torch.Tensor  # [R] int64
    q_len: torch.Tensor  # [R] int32


def make_inputs(case: Case, gen: torch.Generator) -> Inputs:
    n, length, bs = case.rows, case.cached + case.new, case.block_size
    nblk = -(-length // bs)
    num_blocks = n * nblk + 7
    shape = (num_blocks, bs, case.kv_heads, case.head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[: n * nblk].view(n, nblk)
    q = torch.randn(n * case.new, case.heads, case.head_dim, generator=gen)
    return Inputs(
        q,
        k_cache,
        v_cache,
        table,
        table.reshape(-1).to(torch.int32).contiguous(),
        torch.arange(n, dtype=torch.int64) * nblk,
        torch.full((n,), length, dtype=torch.int32),
        torch.arange(n, dtype=torch.int64) * case.new,
        torch.full((n,), case.new, dtype=torch.int32),
    )


def gather_kv(case: Case, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' K and V: [R, hkv, L, d] each."""
    length = case.cached + case.new
    shape = (case.rows, -1, case.kv_heads, case.head_dim)
    k = x.k_cache[x.table].view(shape)[:, :length].transpose(1, 2)
    v = x.v_cache[x.table].view(shape)[:, :length].transpose(1, 2)
    return k, v


def sdpa_fn(case: Case, x: Inputs, out: torch.Tensor, pregathered: bool) -> Callable[[], None]:
    scale = case.head_dim**-0.5
    n, new, length = case.rows, case.new, case.cached + case.new
    q = x.q.view(n, new, case.heads, case.head_dim).transpose(1, 2)  # [R, hq, new, d]
    mask = None
    if case.cached:  # query i sees keys 0 .. cached + i
        mask = torch.arange(length)[None, :] <= case.cached + torch.arange(new)[:, None]
    kv = gather_kv(case, x) if pregathered else None

    def run() -> None:
        k, v = kv if kv is not None else gather_kv(case, x)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        out.view(n, new, case.heads, case.head_dim).copy_(o.transpose(1, 2))

    return run


def decode_args(case: Case, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query (block_start, kv_len) for the decode kernel: token i of a row sees
    cached + i + 1 keys."""
    per_row = torch.arange(1, case.new + 1, dtype=torch.int32) + case.cached
    kv_len = per_row.repeat(case.rows).contiguous()
    block_start = x.block_start.repeat_interleave(case.new).contiguous()
    return block_start, kv_len


def bench_case(case: Case, threads: int, repeats: int, gen: torch.Generator) -> dict[str, float]:
    extend, decode = load_paged_extend(), load_paged_decode()
    x = make_inputs(case, gen)
    scale = case.head_dim**-0.5
    outs = {m: torch.empty_like(x.q) for m in ("extend", "decode", "sdpa", "sdpa-only")}
    d_start, d_len = decode_args(case, x)
    fns: dict[str, Callable[[], None]] = {
        "sdpa": sdpa_fn(case, x, outs["sdpa"], pregathered=False),
        "sdpa-only": sdpa_fn(case, x, outs["sdpa-only"], pregathered=True),
    }
    if extend is not None:
        ext_args = (x.q, x.k_cache, x.v_cache, x.kv_indices, x.block_start, x.kv_len)
        ext_args += (x.q_start, x.q_len)
        fns["extend"] = lambda: extend(*ext_args, scale, outs["extend"], num_threads=threads)
    if decode is not None:
        dec_args = (x.q, x.k_cache, x.v_cache, x.kv_indices, d_start, d_len)
        fns["decode"] = lambda: decode(*dec_args, scale, outs["decode"], num_threads=threads)
    for fn in fns.values():  # warm-up
        fn()
    for m in fns:
        torch.testing.assert_close(outs[m], outs["sdpa"], atol=2e-5, rtol=1e-4, msg=m)
    times: dict[str, list[float]] = {m: [] for m in fns}
    for _ in range(repeats):
        for m, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[m].append((time.perf_counter() - t0) * 1e3)
    return {m: statistics.median(t) for m, t in times.items()}


def gflop(case: Case) -> float:
    """QK and PV multiply-adds of the causal attention (2 flops each), in GFLOP."""
    keys = case.new * case.cached + case.new * (case.new + 1) / 2  # per row and head
    return 4 * case.rows * case.heads * keys * case.head_dim / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    cols = ["extend", "decode", "sdpa", "sdpa-only"]
    print(f"threads {args.threads}, median of {args.repeats} interleaved repeats, ms a layer")
    print("| case | " + " | ".join(cols) + " | extend GFLOP/s | sdpa / extend |")
    print("|---|" + "---:|" * (len(cols) + 2))
    for case in CASES:
        t = bench_case(case, args.threads, args.repeats, gen)
        cells = [f"{t[c]:.2f}" if c in t else "n/a" for c in cols]
        rate = f"{gflop(case) / t['extend'] * 1e3:.0f}" if "extend" in t else "n/a"
        ratio = f"{t['sdpa'] / t['extend']:.1f}x" if "extend" in t else "n/a"
        print(f"| {case.name} | " + " | ".join(cells) + f" | {rate} | {ratio} |")


if __name__ == "__main__":
    main()
