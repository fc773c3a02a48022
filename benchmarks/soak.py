"""Soak test (not in CI): many requests against a live server with random aborts and
client disconnects; reports throughput, errors by kind, and leaks.

    python -m benchmarks.soak                       # tiny model, CPU, modest defaults
    python -m benchmarks.soak --requests 5000 --concurrency 32 --abort-rate 0.1 \\
        --disconnect-rate 0.1 --serve-args "--device cpu --num-kv-blocks 256"
    python -m benchmarks.soak --url http://127.0.0.1:30000   # a running server (with
                                                             # --enable-debug-endpoints)

Requests mix the three APIs (/generate streaming, /v1/completions streaming or not,
/v1/chat/completions), short prompts and long ones that share a few prefixes (the radix
cache's case). A fraction is aborted through POST /abort after the first streamed event,
another fraction is dropped by the client mid-stream. Reported: requests/s and output
tokens/s, outcomes by kind, and leaks: front in-flight and KV blocks in use once idle
(both must be 0), and the RSS of the front and scheduler processes before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import tempfile
import time
import urllib.request
from collections import Counter
from typing import Any

import aiohttp

WORDS = ["the", "a", "radix", "tree", "cache", "block", "token", "prefix", "request", "model"]
IDLE_TIMEOUT_S = 30.0


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def make_prompt(rng: random.Random, prefixes: list[str], long_fraction: float) -> str:
    tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
    if rng.random() < long_fraction:
        return rng.choice(prefixes) + " " + tail
    return tail


async def one(
    http: aiohttp.ClientSession,
    url: str,
    i: int,
    rng: random.Random,
    args: argparse.Namespace,
    prefixes: list[str],
) -> tuple[str, int]:
    """(outcome, output tokens) of one request."""
    prompt = make_prompt(rng, prefixes, args.long_fraction)
    max_tokens = rng.randint(1, args.max_tokens)
    fate = rng.random()
    abort = fate < args.abort_rate
    disconnect = not abort and fate < args.abort_rate + args.disconnect_rate
    api = "generate" if abort else rng.choice(["generate", "completions", "chat"])
    stream = abort or disconnect or rng.random() < 0.5
    rid = f"soak-{i}"
    if api == "generate":
        path = "/generate"
        sp = {"max_new_tokens": max_tokens, "temperature": rng.choice([0, 0.8])}
        body: dict[str, Any] = {"text": prompt, "sampling_params": sp, "rid": rid}
    elif api == "completions":
        path = "/v1/completions"
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8}
    else:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    body["stream"] = stream
    if stream and api != "generate":
        body["stream_options"] = {"include_usage": True}
    try:
        async with http.post(url + path, json=body) as resp:
            if resp.status != 200:
                return f"http_{resp.status}", 0
            if not stream:
                out = await resp.json()
                usage = out["meta_info"] if api == "generate" else out["usage"]
                return "ok", usage["completion_tokens"]
            tokens, events = 0, 0
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "stream_error", tokens
                events += 1
                if api == "generate":
                    tokens = event["meta_info"]["completion_tokens"]  # so far (any stream mode)
                elif event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if events == 1 and abort:
                    async with http.post(url + "/abort", json={"rid": rid}) as a:
                        await a.read()
                if events == 1 and disconnect:
                    resp.close()  # drop the connection mid-stream
                    return "disconnected", tokens
            return ("aborted" if abort else "ok"), tokens
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return type(e).__name__, 0


async def drive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(4)]
    outcomes: Counter[str] = Counter()
    tokens = 0
    sem = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def run(i: int) -> None:
            nonlocal tokens
            async with sem:
                outcome, n = await one(http, url, i, random.Random(rng.random()), args, prefixes)
            outcomes[outcome] += 1
            tokens += n

        t0 = time.perf_counter()
        await asyncio.gather(*(run(i) for i in range(args.requests)))
        elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "outcomes": dict(outcomes), "output_tokens": tokens}


def wait_idle(url: str) -> dict[str, Any]:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        st = get_json(url + "/debug/state")
        snap = st["scheduler"] or {}
        idle = st["in_flight"] == 0 and not snap.get("running") and not snap.get("waiting")
        if (idle and not snap.get("kv_blocks_in_use")) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def soak(url: str, front_pid: int | None, args: argparse.Namespace) -> dict[str, Any]:
    warm = argparse.Namespace(**{**vars(args), "requests": 8, "abort_rate": 0.0})
    asyncio.run(drive(url, warm))
    before = wait_idle(url)
    sched_pid = before.get("scheduler_pid")
    rss_before = {"front": rss_mb(front_pid), "scheduler": rss_mb(sched_pid)}
    result = asyncio.run(drive(url, args))
    after = wait_idle(url)
    snap = after["scheduler"] or {}
    outcomes = result["outcomes"]
    done = sum(n for k, n in outcomes.items() if k in ("ok", "aborted", "disconnected"))
    return {
        **result,
        "requests_per_s": done / result["elapsed_s"],
        "output_tokens_per_s": result["output_tokens"] / result["elapsed_s"],
        "leaks": {
            "front_in_flight": after["in_flight"],
            "kv_blocks_in_use": snap.get("kv_blocks_in_use"),
            "integrity_error": snap.get("integrity_error"),
            "serving": after["serving"],
        },
        "rss_mb_before": rss_before,
        "rss_mb_after": {"front": rss_mb(front_pid), "scheduler": rss_mb(sched_pid)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--front-pid", type=int, default=None, help="with --url: for its RSS")
    p.add_argument("--model", default=None, help="model dir for the started server (tiny)")
    p.add_argument("--serve-args", default="--device cpu --dtype float32")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--abort-rate", type=float, default=0.1)
    p.add_argument("--disconnect-rate", type=float, default=0.1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--long-fraction", type=float, default=0.5, help="prompts on a shared prefix")
    p.add_argument("--prefix-words", type=int, default=300)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args()
    if args.url is not None:
        report = soak(args.url.rstrip("/"), args.front_pid, args)
    else:
        from benchmarks.http_driver import ServerProcess
        from radixrt.model.tiny import ensure_tiny_model

        log = os.path.join(tempfile.gettempdir(), "radixrt-soak.log")
        model = args.model or ensure_tiny_model()
        with ServerProcess(model, shlex.split(args.serve_args), log) as server:
            report = soak(server.url, server.proc.pid, args)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    leaks = report["leaks"]
    if leaks["front_in_flight"] or leaks["kv_blocks_in_use"] or leaks["integrity_error"]:
        raise SystemExit("LEAK: the server holds state after the soak (see 'leaks')")


if __name__ == "__main__":
    main()
