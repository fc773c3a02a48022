"""radixrt vs HF transformers on CPU, paired: both in one process, alternating, N rounds.

    python -m benchmarks.bench_cpu_paired --rounds 8 --threads 1

On a shared, noisy machine two separate runs of `bench_hf` and `bench_serving` can differ by
30% from the host alone; here each round runs HF's `generate` (as `bench_hf` does: one static
batch, greedy, ignore EOS) and then the in-process engine (as `bench_serving --backend engine`
does: `run_engine`, the same duration), alternating which goes first, on the same workload
(`random`, `--size`), so each round's ratio compares the two under the same load. Prints out
tok/s per round, the medians and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch


def engine_and_workload(threads: int, size: str, block_size: int = 16):
    """The in-process engine as `bench_serving --backend engine` builds it on the trained
    tiny model, warmed up, and the `random` workload at `size`."""
    from benchmarks.backends import warmup_workload
    from benchmarks.engine_driver import run_engine
    from benchmarks.workloads import make_workload
    from radixrt.engine import Engine
    from radixrt.model.tiny import ensure_tiny_model

    engine = Engine(
        ensure_tiny_model(),
        device="cpu",
        prefix_cache="radix",
        policy="lpm",
        block_size=block_size,
        cpu_threads=threads,
        freeze_gc=True,
        max_num_batched_tokens=8192,
        max_running_requests=256,
    )  # bench_serving's
    vocab = engine.model_config.vocab_size
    run_engine(engine, warmup_workload(vocab))
    engine.cache.reset()
    return engine, make_workload("random", size, 1.0, 0, vocab)


def main(argv: list[str] | None = None) -> list[tuple[float, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (both)")
    p.add_argument("--size", default="smoke", choices=["full", "smoke"])
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from benchmarks.bench_hf import generate, load_model
    from benchmarks.engine_driver import run_engine
    from radixrt.model.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model()
    engine, w = engine_and_workload(args.threads, args.size, args.block_size)
    prompts = [prog.calls[0].input_ids for prog in w.programs]
    out_len = w.params["output_len"]
    n_out = len(prompts) * out_len
    hf = load_model(model_dir, False, "cpu", torch.float32)
    with torch.inference_mode():
        generate(hf, [q[:16] for q in prompts[:2]], 4, "cpu")  # warm-up

    def run_hf() -> float:
        with torch.inference_mode():
            return n_out / generate(hf, prompts, out_len, "cpu")

    def run_radixrt() -> float:
        result = run_engine(engine, w)
        engine.cache.reset()
        return n_out / result.duration_s

    rows = []
    for r in range(args.rounds):
        if r % 2 == 0:
            hf_tps, rt_tps = run_hf(), run_radixrt()
        else:
            rt_tps = run_radixrt()
            hf_tps = run_hf()
        rows.append((hf_tps, rt_tps))
        load = os.getloadavg()[0]
        print(f"round {r + 1}: HF {hf_tps:.0f} out tok/s, radixrt {rt_tps:.0f} "
              f"({rt_tps / hf_tps:.2f}x), load {load:.2f}", flush=True)  # fmt: skip
    engine.shutdown()
    hf_med = statistics.median(h for h, _ in rows)
    rt_med = statistics.median(t for _, t in rows)
    ratio = statistics.median(t / h for h, t in rows)
    print(f"median: HF {hf_med:.0f}, radixrt {rt_med:.0f} out tok/s; per-round ratio median "
          f"{ratio:.2f}x (best {max(t / h for h, t in rows):.2f}x)")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
