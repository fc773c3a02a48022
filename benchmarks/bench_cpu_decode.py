"""CPU decode paths side by side, in one process, alternating: the native one-call decode
forward (radixrt.model.cpu_decode, the default) against the layer-by-layer forward
(`model.cpu_decode = False`), on bench_cpu_paired's workload (`random`, `--size`).

    python -m benchmarks.bench_cpu_decode --rounds 8 --threads 1

Per variant: the median over rounds of the prefill step, of the median decode step, and of
the whole run (32 requests x 128 prompt tokens x 32 output tokens at smoke size).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, float, float]]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--size", default="smoke", choices=["full", "smoke"])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from benchmarks.bench_cpu_paired import engine_and_workload
    from radixrt import SamplingParams

    engine, w = engine_and_workload(args.threads, args.size)
    params = SamplingParams(max_tokens=w.params["output_len"], temperature=0, ignore_eos=True)
    model, core = engine.core.runner.model, engine.core
    variants = {"native forward": True, "layers": False}
    res: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for name in order:
            model.cpu_decode = variants[name]
            for prog in w.programs:
                core.add_request(prog.calls[0].input_ids, params)
            steps = []
            while core.has_work:
                t0 = time.perf_counter()
                core.step()
                steps.append(time.perf_counter() - t0)
            engine.cache.reset()
            res[name].append((steps[0], statistics.median(steps[1:]), sum(steps)))
    model.cpu_decode = True
    print(f"{'variant':16s} {'prefill ms':>10s} {'decode step ms':>14s} {'run ms':>8s}")
    for name, rows in res.items():
        pre, dec, tot = (statistics.median(x[i] for x in rows) * 1e3 for i in range(3))
        print(f"{name:16s} {pre:10.1f} {dec:14.2f} {tot:8.1f}")
    engine.check_integrity()
    return res


if __name__ == "__main__":
    main()
