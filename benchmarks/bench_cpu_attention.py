"""CPU attention: the exact reference ("torch-reference") vs the SDPA backend ("torch"), with
the native kernel for decode and small extend rows off ("sdpa") and on ("native", what
attention_backend="torch" runs on a CPU with a float32 pool; see attention/native_rows).

Times one step (`prepare` + `forward` of `--layers` layers: store K/V + attend) and the layers
alone (per layer: their time / layers) on representative batches over a random KV pool, float32,
at each thread count of `--threads`. Prints median (min) of `--repeats` runs (`--ref-repeats`
for the slow reference) after one warm-up as a markdown table; checks both backends agree.

    python -m benchmarks.bench_cpu_attention --threads 1,2 --repeats 7 --ref-repeats 3

`--engine N,IN,OUT` instead times the whole tiny-model Engine (output tok/s) with each backend.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from radixrt.attention.forward_batch import reference_batch
from radixrt.attention.sdpa_backend import SdpaAttentionBackend
from radixrt.attention.sdpa_plan import DEFAULT_LIMITS, PlanLimits
from radixrt.attention.torch_backend import TorchAttentionBackend
from radixrt.kernels.paged_decode_cpu import load_paged_decode
from radixrt.kv.pool import KVPool

BLOCK_SIZE = 16
SHAPES = {  # name -> (num_heads, num_kv_heads, head_dim)
    "tiny (8/2 x 32)": (8, 2, 32),  # the tiny model's attention
    "large (32/8 x 128)": (32, 8, 128),  # Llama-3-8B's
}


def cases(gen: torch.Generator) -> dict[str, tuple[list[tuple[int, int]], int]]:
    """name -> (rows [(num_cached, num_new)], num_decode)."""
    randint = lambda lo, hi, n: torch.randint(lo, hi + 1, (n,), generator=gen).tolist()  # noqa: E731
    ctx = lambda n: randint(256, 1024, n)  # noqa: E731
    decode = [(c, 1) for c in ctx(32)]
    short = randint(16, 256, 8)
    return {
        "32 decode (ctx 256-1024)": (decode, 32),
        "32 decode + 1 x 512 extend": (decode + [(0, 512)], 32),
        "32 decode + 512 extend on 512 cached": (decode + [(512, 512)], 32),
        "16 decode + 8 short extends on prefixes": (
            decode[:16] + [(c, n) for c, n in zip(ctx(8), short)],
            16,
        ),
        "64 extends, 1-64 new on 0-1024 cached": (
            [(c, n) for c, n in zip(randint(0, 1024, 64), randint(1, 64, 64))],
            0,
        ),
    }


def make_batch(rows: list[tuple[int, int]], num_decode: int, gen: torch.Generator):
    """CPU ForwardBatch over blocks scattered at random in the pool; returns (batch, blocks)."""
    cached = torch.tensor([c for c, _ in rows], dtype=torch.int32)
    new = torch.tensor([n for _, n in rows], dtype=torch.int32)
    seq_lens = cached + new
    nblocks = (seq_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = int(nblocks.sum()) + 1
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(rows), int(nblocks.max()), dtype=torch.int32)
    ends = torch.cumsum(nblocks, 0).tolist()
    for r, (nb, end) in enumerate(zip(nblocks.tolist(), ends)):
        table[r, :nb] = perm[end - nb : end]
    batch = reference_batch(table, cached, new, num_decode, BLOCK_SIZE)
    return batch, num_blocks


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(min, median) milliseconds of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def bench_case(
    rows, num_decode, shape, layers: int, repeats: int, ref_repeats: int, limits: PlanLimits, gen
) -> dict[str, tuple]:
    hq, hkv, d = shape
    batch, num_blocks = make_batch(rows, num_decode, gen)
    pool = KVPool(layers, num_blocks, BLOCK_SIZE, hkv, d, torch.float32, "cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    t = batch.num_tokens
    qkv = [
        (torch.randn(t, hq, d, generator=gen), *torch.randn(2, t, hkv, d, generator=gen))
        for _ in range(layers)
    ]
    result, outs = {}, {}
    backends = [
        ("reference", TorchAttentionBackend(hq, hkv, d)),
        ("sdpa", SdpaAttentionBackend(hq, hkv, d, limits)),
    ]
    if load_paged_decode() is not None:
        backends.append(("native", SdpaAttentionBackend(hq, hkv, d, limits, native_decode=True)))
    for name, backend in backends:

        def layers_fwd(backend=backend) -> list[torch.Tensor]:
            return [backend.forward(i, *qkv[i], pool) for i in range(layers)]

        def step(backend=backend) -> list[torch.Tensor]:
            backend.prepare(batch)
            return layers_fwd(backend)

        outs[name] = step()
        runs = ref_repeats if name == "reference" else repeats
        per_layer = tuple(ms / layers for ms in timed(layers_fwd, runs))
        result[name] = (per_layer, timed(step, runs))
    for name in outs:
        for a, b in zip(outs["reference"], outs[name]):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    return result


def bench_engine(backend: str, num_prompts: int, input_len: int, output_len: int) -> float:
    """Output tokens/s of the tiny model (float32, CPU, no prefix cache) with `backend`:
    `num_prompts` random prompts of `input_len` tokens, `output_len` greedy tokens each."""
    from radixrt import Engine, SamplingParams
    from radixrt.model.tiny import ensure_tiny_model

    engine = Engine(
        ensure_tiny_model(), device="cpu", attention_backend=backend, prefix_cache="none"
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(
        10, engine.model_config.vocab_size, (num_prompts, input_len), generator=gen
    ).tolist()
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine.generate(prompt_token_ids=ids[:2], sampling_params=params)  # warm-up
    start = time.perf_counter()
    engine.generate(prompt_token_ids=ids, sampling_params=params)
    return num_prompts * output_len / (time.perf_counter() - start)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or "unknown CPU"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--ref-repeats", type=int, default=3, help="repeats of the (slow) reference")
    p.add_argument("--layers", type=int, default=4, help="layers in one step (tiny model: 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-waste", type=float, default=DEFAULT_LIMITS.max_waste)
    p.add_argument("--shapes", default="tiny,large", help="comma-separated: tiny, large")
    p.add_argument(
        "--engine",
        default=None,
        metavar="N,IN,OUT",
        help="instead: tiny-model Engine tok/s, N prompts of IN tokens, OUT tokens each",
    )
    args = p.parse_args()
    if args.engine:
        n, inp, out = (int(x) for x in args.engine.split(","))
        for threads in (int(x) for x in args.threads.split(",")):
            torch.set_num_threads(threads)
            for backend in ("torch-reference", "torch"):
                tok_s = bench_engine(backend, n, inp, out)
                print(
                    f"engine {backend}: {threads} threads, {n} x {inp} -> {out}: {tok_s:.1f} tok/s"
                )
        return
    print(
        f"{cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}, float32, "
        f"block size {BLOCK_SIZE}, {args.layers} layers/step, max_waste {args.max_waste}; "
        "ms: median (min)"
    )
    cols = "ref ms/layer | sdpa ms/layer | native ms/layer | ref/sdpa | sdpa/native"
    cols += " | ref ms/step | sdpa ms/step | native ms/step"
    print(f"| shape | batch | threads | {cols} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    limits = DEFAULT_LIMITS._replace(max_waste=args.max_waste)
    fmt = lambda mm: f"{mm[1]:.2f} ({mm[0]:.2f})"  # noqa: E731
    for threads in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(threads)
        for shape_name, shape in SHAPES.items():
            if shape_name.split()[0] not in args.shapes.split(","):
                continue
            gen = torch.Generator().manual_seed(args.seed)
            for case_name, (rows, nd) in cases(gen).items():
                r = bench_case(
                    rows, nd, shape, args.layers, args.repeats, args.ref_repeats, limits, gen
                )
                (ref_l, ref_s), (fast_l, fast_s) = r["reference"], r["sdpa"]
                nat_l, nat_s = r.get("native", ((float("nan"),) * 2,) * 2)
                print(
                    f"| {shape_name} | {case_name} | {torch.get_num_threads()} "
                    f"| {fmt(ref_l)} | {fmt(fast_l)} | {fmt(nat_l)} | {ref_l[1] / fast_l[1]:.1f}"
                    f" | {fast_l[1] / nat_l[1]:.2f} | {fmt(ref_s)} | {fmt(fast_s)} "
                    f"| {fmt(nat_s)} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
