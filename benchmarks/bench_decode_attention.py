"""Paged decode attention kernels on the Llama-3-8B shape (32 q heads, 8 KV heads, head dim 128,
block size 16), one decode step's 32 layers inside a CUDA graph, bf16 and fp8 KV:

- fa2-tc: FlashInfer's BatchDecodeWithPagedKVCacheWrapper with tensor cores on the fa2
  backend (what `radixrt.attention.flashinfer_backend` runs today);
- cuda-core: the same wrapper without tensor cores;
- xqa: FlashInfer's `xqa_batch_decode_with_kv_cache` (TensorRT-LLM's XQA decode kernel; on
  Hopper an fp8 cache runs its fp8 tensor-core kernel), over a padded block table.

Each layer reads its own cache (as a model does: no layer hits L2 for another's KV); pages are
a random permutation of the pool. Reported: microseconds per layer (median graph replay / 32),
the KV bytes read per second, and each kernel's relative error (L2) against float32 attention
over the same (dequantized) cache, layer 0.

    python -m benchmarks.bench_decode_attention [--batches 1,32,256] [--context 1024]
        [--variants fa2-tc,cuda-core,xqa] [--kv-dtypes bf16,fp8] [--table-width N] [--json PATH]

CUDA only (compute capability 9.0 for xqa's fp8 kernel).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from benchmarks.bench_fp8_gemm import graph_ms

LAYERS, HQ, HKV, D, PAGE = 32, 32, 8, 128, 16
VARIANTS = ("fa2-tc", "cuda-core", "xqa")
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def make_caches(batch: int, context: int, kv_dtype: torch.dtype, gen: torch.Generator, width: int):
    """32 layers' caches and a [batch, width] block table (columns past the context: 0)."""
    pages_per_row = math.ceil(context / PAGE)
    num_pages = batch * pages_per_row
    caches = []
    for _ in range(LAYERS):
        k = torch.randn((num_pages, PAGE, HKV, D), generator=gen, device="cuda")
        v = torch.randn((num_pages, PAGE, HKV, D), generator=gen, device="cuda")
        caches.append((k.to(kv_dtype), v.to(kv_dtype)))
    perm = torch.randperm(num_pages, generator=gen, device="cuda").to(torch.int32)
    table = torch.zeros((batch, max(width, pages_per_row)), dtype=torch.int32, device="cuda")
    table[:, :pages_per_row] = perm.reshape(batch, pages_per_row)
    return caches, table


def build(variant: str, batch: int, context: int, table: torch.Tensor, kv_dtype, caches):
    """A function running one layer's attention: fn(layer, q, out)."""
    import flashinfer
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    sm_scale = D**-0.5
    pages_per_row = math.ceil(context / PAGE)
    if variant == "xqa":
        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")

        def run(layer, q, out):
            xqa_batch_decode_with_kv_cache(
                q, caches[layer], workspace, table, seq_lens, context,
                bmm1_scale=sm_scale, bmm2_scale=1.0, out=out, kv_layout="NHD",
            )  # fmt: skip

        return run
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages_per_row
    indices = table[:, :pages_per_row].reshape(-1).contiguous()
    last = torch.full((batch,), context - (pages_per_row - 1) * PAGE, dtype=torch.int32)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=variant == "fa2-tc",
        paged_kv_indptr_buffer=indptr.clone(),
        paged_kv_indices_buffer=indices.clone(),
        paged_kv_last_page_len_buffer=last.cuda(),
        backend="fa2",
    )
    plan = dict(q_data_type=torch.bfloat16, kv_data_type=kv_dtype, sm_scale=sm_scale)
    if variant == "fa2-tc":  # the tensor-core plan takes the longest length (as radixrt's)
        plan["seq_lens"] = torch.tensor([context], dtype=torch.int32)
    wrapper.plan(indptr.cpu(), indices, last, HQ, HKV, D, PAGE, **plan)

    def run(layer, q, out):
        wrapper.run(q, caches[layer], out=out)

    return run


def reference(q: torch.Tensor, caches, table: torch.Tensor, context: int) -> torch.Tensor:
    """Layer 0's attention in float32 over the dequantized cache [B, HQ, D]."""
    k_cache, v_cache = caches[0]
    pages = table[:, : math.ceil(context / PAGE)].long()
    k = k_cache[pages].float().reshape(q.shape[0], -1, HKV, D)[:, :context]
    v = v_cache[pages].float().reshape(q.shape[0], -1, HKV, D)[:, :context]
    qf = q.float().reshape(q.shape[0], HKV, HQ // HKV, D)
    scores = torch.einsum("bhgd,bthd->bhgt", qf, k) * D**-0.5
    out = torch.einsum("bhgt,bthd->bhgd", scores.softmax(-1), v)
    return out.reshape(q.shape)


def all_layers(run, q: torch.Tensor, out: torch.Tensor):
    """One decode step's attention: `run` over every layer's cache."""

    def step() -> None:
        for layer in range(LAYERS):
            run(layer, q, out)

    return step


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--kv-dtypes", default="bf16,fp8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--table-width",
        type=int,
        default=0,
        help="xqa's block-table columns (0: the context's; a CUDA graph's: max_model_len / 16)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for kv_name in args.kv_dtypes.split(","):
        kv_dtype = KV_DTYPES[kv_name]
        for batch in map(int, args.batches.split(",")):
            caches, table = make_caches(batch, args.context, kv_dtype, gen, args.table_width)
            q = torch.randn((batch, HQ, D), generator=gen, device="cuda").to(torch.bfloat16)
            exact = reference(q, caches, table, args.context)
            for variant in variants:
                out = torch.empty_like(q)
                try:
                    run = build(variant, batch, args.context, table, kv_dtype, caches)
                    run(0, q, out)
                    torch.cuda.synchronize()
                    ms = graph_ms(all_layers(run, q, out), 1, args.reps)
                except Exception as e:  # a variant this build cannot run: say so, go on
                    print(f"{kv_name} B={batch} {variant}: {type(e).__name__}: {e}", flush=True)
                    continue
                run(0, q, out)
                torch.cuda.synchronize()
                rel = ((out.float() - exact).norm() / exact.norm()).item()
                kv_bytes = batch * args.context * HKV * D * 2 * caches[0][0].element_size()
                us = ms * 1e3 / LAYERS
                row = dict(kv=kv_name, batch=batch, context=args.context, variant=variant,
                           us_per_layer=round(us, 2), kv_tb_per_s=round(kv_bytes / us / 1e6, 2),
                           rel_error=round(rel, 5))  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            del caches
            torch.cuda.empty_cache()
    print("\n| KV | B | " + " | ".join(f"{v} us/layer (TB/s)" for v in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for kv_name in args.kv_dtypes.split(","):
        for batch in map(int, args.batches.split(",")):
            cells = []
            for v in variants:
                hit = [
                    r for r in rows if (r["kv"], r["batch"], r["variant"]) == (kv_name, batch, v)
                ]
                cells.append(f"{hit[0]['us_per_layer']} ({hit[0]['kv_tb_per_s']})" if hit else "-")
            print(f"| {kv_name} | {batch} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
