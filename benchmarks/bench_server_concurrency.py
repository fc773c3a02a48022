"""Throughput and TTFT of N concurrent short streaming requests against `radixrt serve`.

    python -m benchmarks.bench_server_concurrency   # starts a CPU server on the tiny model
    python -m benchmarks.bench_server_concurrency --url http://127.0.0.1:30000

Each request streams POST /generate (distinct prompts, greedy, ignore_eos); TTFT is the
time from sending to the first event carrying tokens. Prints requests/s, output tokens/s
and mean / P50 / P99 TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

import aiohttp


async def one(http: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> tuple[float, int]:
    body = {
        "text": f"Request {i}: tell me about topic number {i * 7 % 100}",
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with http.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["output_ids"] and ttft is None:
                ttft = time.perf_counter() - t0
            tokens = event["meta_info"]["completion_tokens"]  # so far (any stream mode)
    assert ttft is not None and tokens == max_tokens
    return ttft, tokens


async def run(url: str, n: int, max_tokens: int) -> dict[str, float]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        await asyncio.gather(*(one(http, url, -1 - i, 4) for i in range(4)))  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(http, url, i, max_tokens) for i in range(n)))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    return {
        "requests": n,
        "wall_s": wall,
        "requests_per_s": n / wall,
        "output_tokens_per_s": sum(r[1] for r in results) / wall,
        "ttft_mean_ms": 1000 * statistics.mean(ttfts),
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default=None, help="model dir for the started server (tiny)")
    p.add_argument("-n", type=int, default=64, help="concurrent requests")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    if args.url is not None:
        stats = asyncio.run(run(args.url, args.n, args.max_tokens))
    else:
        from benchmarks.http_driver import ServerProcess
        from radixrt.model.tiny import ensure_tiny_model

        serve_args = ["--device", "cpu", "--dtype", "float32"]
        log = os.path.join(tempfile.gettempdir(), "bench_server_concurrency.log")
        with ServerProcess(args.model or ensure_tiny_model(), serve_args, log) as server:
            asyncio.run(run(server.url, 4, args.max_tokens))  # warm-up
            stats = asyncio.run(run(server.url, args.n, args.max_tokens))
    for k, v in stats.items():
        print(f"{k:>20}: {v:.3g}" if isinstance(v, float) else f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
