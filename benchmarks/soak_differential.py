"""Differential soak (minutes; the CI test tests/test_differential_soak.py is its small case):
seeded mixed workloads against a plain server and against each feature configuration of
`benchmarks.differential.CONFIGS`; counts the greedy answers compared and the mismatches.

    python -m benchmarks.soak_differential                         # tiny model, CPU
    python -m benchmarks.soak_differential --seeds 0-9 --requests 300 --configs host host+ngram

Each configuration's server runs every seed's workload (aborts and disconnects included) and
must be idle and balanced afterwards; the reference runs each workload to the end. Exits
non-zero on a mismatch or an unbalanced server.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from benchmarks.differential import (
    CONFIGS,
    REFERENCE_ARGS,
    check_balanced,
    compare,
    make_workload,
    run_workload,
)
from benchmarks.http_driver import ServerProcess

CPU_ARGS = ["--device", "cpu", "--dtype", "float32"]
STATS = ("preemptions", "forks", "beam_steps", "host_loaded_blocks", "host_written_back_blocks")


def seed_list(text: str) -> list[int]:
    """'3' -> [0, 1, 2]; '4-7' -> [4, 5, 6, 7]; '1,5' -> [1, 5]."""
    if "-" in text:
        lo, hi = map(int, text.split("-"))
        return list(range(lo, hi + 1))
    if "," in text:
        return [int(s) for s in text.split(",")]
    return list(range(int(text)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the tiny model)")
    p.add_argument("--seeds", default="4", help="N (0..N-1), A-B or A,B,...")
    p.add_argument("--requests", type=int, default=200, help="per seed")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args()
    from radixrt.model.tiny import ensure_tiny_model

    model = args.model or ensure_tiny_model()
    log = os.path.join(tempfile.gettempdir(), "radixrt-soak-differential.log")
    workloads = {s: make_workload(s, args.requests, args.max_tokens) for s in seed_list(args.seeds)}
    start = time.perf_counter()
    with ServerProcess(model, CPU_ARGS + REFERENCE_ARGS, log) as srv:
        reference = {}
        for jobs in workloads.values():
            reference.update(run_workload(srv.url, jobs, args.concurrency, fates=False))
        check_balanced(srv.url)
    report: dict = {"seeds": list(workloads), "requests_per_seed": args.requests, "configs": {}}
    failed = False
    for name in args.configs:
        with ServerProcess(model, CPU_ARGS + CONFIGS[name], log) as srv:
            compared, mismatches = 0, []
            for jobs in workloads.values():
                answers = run_workload(srv.url, jobs, args.concurrency)
                result = compare(jobs, reference, answers)
                compared += result.num_compared
                mismatches += result.mismatches
            snap = check_balanced(srv.url)
        report["configs"][name] = {
            "greedy_compared": compared,
            "mismatches": len(mismatches),
            "first_mismatches": mismatches[:5],
            **{k: snap[k] for k in STATS},
        }
        failed |= bool(mismatches)
        print(name, json.dumps(report["configs"][name]), flush=True)
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if failed:
        raise SystemExit("MISMATCH: a configuration's greedy answers differ from the reference")


if __name__ == "__main__":
    main()
