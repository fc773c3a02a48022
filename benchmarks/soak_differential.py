"""Differential soak (minutes; the CI test tests/test_differential_soak.py is its small case):
seeded mixed workloads against a plain server and against each feature configuration of
`benchmarks.differential.CONFIGS`, and the LoRA mix (`lora`: two PEFT adapters made at the
start and the base model in one workload, against each request run alone without a prefix
cache); counts the greedy answers compared and the mismatches.

    python -m benchmarks.soak_differential                         # tiny model, CPU
    python -m benchmarks.soak_differential --seeds 0-9 --requests 300 --configs host host+ngram
    python -m benchmarks.soak_differential --seeds 3 --requests 100 --configs lora

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
    LORA_ADAPTERS,
    LORA_REFERENCE_ARGS,
    REFERENCE_ARGS,
    check_balanced,
    compare,
    lora_args,
    lora_config,
    make_lora_adapters,
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
    p.add_argument("--configs", nargs="*", default=[*CONFIGS, "lora"], choices=[*CONFIGS, "lora"])
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args()
    from radixrt.model.tiny import ensure_tiny_model

    model = args.model or ensure_tiny_model()
    log = os.path.join(tempfile.gettempdir(), "radixrt-soak-differential.log")
    seeds = seed_list(args.seeds)
    start = time.perf_counter()
    report: dict = {"seeds": seeds, "requests_per_seed": args.requests, "configs": {}}
    failed = False
    plain = [name for name in args.configs if name != "lora"]
    if plain:
        workloads = {s: make_workload(s, args.requests, args.max_tokens) for s in seeds}
        reference = run_all(model, REFERENCE_ARGS, log, workloads, args.concurrency, None)
        for name in plain:
            args_ = CONFIGS[name]
            result = run_all(model, args_, log, workloads, args.concurrency, reference)
            report["configs"][name] = result
            failed |= bool(result["mismatches"])
            print(name, json.dumps(result), flush=True)
    if "lora" in args.configs:
        with tempfile.TemporaryDirectory() as tmp:
            paths = make_lora_adapters(model, tmp)
            loras = LORA_ADAPTERS
            workloads = {s: make_workload(s, args.requests, args.max_tokens, loras) for s in seeds}
            ref_args = LORA_REFERENCE_ARGS + lora_args(paths)
            reference = run_all(model, ref_args, log, workloads, 1, None)
            result = run_all(model, lora_config(paths), log, workloads, args.concurrency, reference)
        report["configs"]["lora"] = result
        failed |= bool(result["mismatches"])
        print("lora", json.dumps(result), flush=True)
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if failed:
        raise SystemExit("MISMATCH: a configuration's greedy answers differ from the reference")


def run_all(model, serve_args, log, workloads, concurrency, reference):
    """Every workload on one server. Without `reference`: rid -> Answer, each job run to the
    end; with it: the comparison's counts and the server's stats once idle."""
    with ServerProcess(model, CPU_ARGS + serve_args, log) as srv:
        answers, compared, mismatches = {}, 0, []
        for jobs in workloads.values():
            got = run_workload(srv.url, jobs, concurrency, fates=reference is not None)
            answers.update(got)
            if reference is not None:
                result = compare(jobs, reference, got)
                compared += result.num_compared
                mismatches += result.mismatches
        snap = check_balanced(srv.url)
    if reference is None:
        return answers
    return {
        "greedy_compared": compared,
        "mismatches": len(mismatches),
        "first_mismatches": mismatches[:5],
        **{k: snap[k] for k in STATS},
    }


if __name__ == "__main__":
    main()
