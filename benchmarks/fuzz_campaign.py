"""A long schema fuzz campaign against a live CPU server (tests/test_server_fuzz.py's longer
variant): `--requests` bodies from benchmarks/schema_fuzz.py, `--concurrency` at a time, on a
server with a small KV pool, the host KV tier and ngram speculation.

Prints the answers per route and status and per kind of value, the problems found (a 5xx, an
invalid value accepted, an error naming no field, a hang past --timeout), whether the server
went idle afterwards (front in flight 0, no KV blocks in use, integrity holds), and the front's
and the scheduler's RSS (VmRSS) before the warm-up half, after it and at the end. Exits 1 on
any problem, a leak, or RSS growth over --max-rss-growth in the second half.

    python -m benchmarks.fuzz_campaign --requests 5000 --concurrency 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.schema_fuzz import KINDS, ROUTES, answer_problem, post, rss_kb, schema_case

SERVER_ARGS = (
    "--device", "cpu", "--dtype", "float32", "--enable-debug-endpoints",
    "--num-kv-blocks", "96", "--block-size", "16", "--host-kv-gb", "0.05",
    "--speculative-method", "ngram", "--num-speculative-tokens", "3",
    "--retention-max-ttl-s", "1",
)  # fmt: skip
RETENTION_TTL_S = 1.0  # cache_ttl_s holds end this soon: no KV in use afterwards


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def start_server(model: str | None, port: int, log_path: str, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "radixrt.cli", "serve", "--port", str(port), *SERVER_ARGS]
    cmd += extra
    cmd += ["--model", model] if model else []
    log = open(log_path, "w")  # noqa: SIM115 (the server's lifetime)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {Path(log_path).read_text()[-3000:]}")
        try:
            if get_json(f"http://127.0.0.1:{port}/health").get("status") is not None:
                return proc
        except OSError:
            time.sleep(0.2)
    raise TimeoutError("server not ready")


def wait_idle(url: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = get_json(url + "/debug/state")
        snap = st["scheduler"]
        idle = st["in_flight"] == 0 and snap["running"] == snap["waiting"] == 0
        if idle and snap["kv_blocks_in_use"] == 0 or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="default: the server's tiny model")
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--serve-args", default="", help="more `radixrt serve` options (one string)")
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    cases = [schema_case(rng) for _ in range(args.requests)]
    url = f"http://127.0.0.1:{args.port}"
    log_path = os.path.join(tempfile.gettempdir(), f"radixrt-fuzz-campaign-{args.port}.log")
    proc = start_server(args.model, args.port, log_path, shlex.split(args.serve_args))
    try:
        pids = {"front": proc.pid, "scheduler": get_json(url + "/debug/state")["scheduler_pid"]}

        def send(case):
            fv, body = case
            t0 = time.monotonic()
            try:
                status, raw = post(url + fv.path, json.dumps(body).encode(), args.timeout)
            except OSError as e:  # a hang (timeout) or a dropped connection
                return 0, repr(e).encode(), time.monotonic() - t0
            return status, raw, time.monotonic() - t0

        half = len(cases) // 2
        rss = {name: [rss_kb(pid)] for name, pid in pids.items()}
        answers = []
        t0 = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            for part in (cases[:half], cases[half:]):
                answers += pool.map(send, part)
                for name, pid in pids.items():
                    rss[name].append(rss_kb(pid))
        elapsed = time.monotonic() - t0
        # the retention holds end at the first scheduler step after their TTL
        time.sleep(RETENTION_TTL_S + 0.5)
        body = json.dumps({"prompt": "after the holds", "max_tokens": 1}).encode()
        after_status, _ = post(url + "/v1/completions", body, args.timeout)
        state = wait_idle(url, 60)
        log = Path(log_path).read_text(errors="replace")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)

    by_route: Counter = Counter()
    by_kind: Counter = Counter()
    problems = []
    for (fv, _), (status, raw, _) in zip(cases, answers):
        by_route[fv.path, status] += 1
        by_kind[fv.kind, status // 100] += 1
        if why := answer_problem(fv, status, raw):
            problems.append(f"{fv.path} {fv.field}={fv.value!r:.80} ({fv.kind}): {why}")
    statuses = sorted({s for _, s in by_route})
    print(f"{len(cases)} requests, concurrency {args.concurrency}, {elapsed:.1f} s")
    print(f"{'route':24}" + "".join(f"{s:>7}" for s in statuses) + f"{'total':>8}")
    for path in ROUTES:
        row = [by_route[path, s] for s in statuses]
        print(f"{path:24}" + "".join(f"{n:>7}" for n in row) + f"{sum(row):>8}")
    print("by kind of value (2xx/4xx/5xx/none): " + ", ".join(
        f"{k} {by_kind[k, 2]}/{by_kind[k, 4]}/{by_kind[k, 5]}/{by_kind[k, 0]}" for k in KINDS
    ))  # fmt: skip
    slowest = max(t for _, _, t in answers)
    print(f"slowest answer {slowest:.1f} s")
    snap = state["scheduler"]
    leak = (
        (state["in_flight"] or snap["running"] or snap["waiting"] or snap["kv_blocks_in_use"])
        or snap["integrity_error"]
        or after_status != 200
    )
    print(
        f"after: in flight {state['in_flight']}, running {snap['running']}, waiting "
        f"{snap['waiting']}, KV blocks in use {snap['kv_blocks_in_use']}, integrity "
        f"{snap['integrity_error'] or 'ok'}"
    )
    grew = []
    for name, (start, mid, end) in rss.items():
        growth = (end - mid) / mid
        print(
            f"RSS {name}: start {start / 1024:.1f} MiB, after warm-up {mid / 1024:.1f} MiB, "
            f"end {end / 1024:.1f} MiB ({growth:+.2%} over the measured half)"
        )
        if growth > args.max_rss_growth:
            grew.append(name)
    tracebacks = log.count("Traceback")
    print(f"problems {len(problems)}, tracebacks in the server log {tracebacks}")
    for line in problems[:30]:
        print("  " + line)
    return 1 if problems or leak or grew or tracebacks else 0


if __name__ == "__main__":
    sys.exit(main())
