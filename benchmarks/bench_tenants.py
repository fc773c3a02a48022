"""What one tenant's claims leave another, on a live server with API keys (tiny model, CPU).

- retention: tenant a sends 40 prompts with `cache_ttl_s` (each under a salt of its own), in
  rounds of 8; after each round tenant b re-sends its 5 system prompts. Per configuration:
  b's cached tokens per round and a's held blocks at the end. Configurations: a's holds
  bounded by the default per-tenant share, by 1.0 (only the pool's `retention_max_share`, as
  before per-tenant bounds), and a without hints (plain LRU).
- starvation: 24 threads of one tenant flood the server at the most urgent priority it may
  claim (-R; 600-token prompts, so a few fill the pool and the rest always queue); a request
  of it at the least urgent one (R) is sent 5 s into the flood. Per configuration and R (10,
  1000; `--repeats` floods, one after another, on one server): its time to first token and
  to its end. Configurations: the default `priority_max_wait_s` and 0 (aging by steps only,
  one level per 256 steps).

    python -m benchmarks.bench_tenants --scenario retention,starvation
Prints one markdown table per scenario.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import threading
import time
import urllib.error
import urllib.request

from benchmarks.http_driver import ServerProcess

POOL_BLOCKS = 256
# a flood request's tokens: a few fill the pool, so most of the 24 always wait
FLOOD_PROMPT, FLOOD_OUTPUT = 600, 64
# the starvation scenario's tenants may claim priorities -R (first) .. R
RANGES = {"narrow": 10, "wide": 1000}
KEYS = "".join(
    [f"key-{t}-0123456789abcdef {t}\n" for t in ("a", "b", *RANGES)]
    + [f"@{t} priority=-{r}..{r}\n" for t, r in RANGES.items()]
)


def post(url: str, key: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(
        url + "/generate",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get(url: str, key: str, path: str) -> dict:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def key(tenant: str) -> str:
    return f"key-{tenant}-0123456789abcdef"


def serve(model: str, keys_path: str, log: str, *args: str) -> ServerProcess:
    common = ["--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    common += ["--num-kv-blocks", str(POOL_BLOCKS), "--api-keys-file", keys_path]
    return ServerProcess(model, [*common, *args], log)


def retention(model: str, keys_path: str, log: str) -> None:
    system = [[100 + 50 * i + j for j in range(75)] for i in range(5)]
    configs = [
        ("a holds, tenant share 0.25 (default)", [], 600),
        (
            "a holds, tenant share 1.0 (pool share 0.8 only)",
            ["--retention-max-tenant-share", "1"],
            600,
        ),
        ("a sends no hints", [], 0),
    ]
    print("| setting | b's cached tokens per round (of 370) | a's held blocks (of 256) |")
    print("|---|---|---|")
    for name, args, ttl in configs:
        with serve(model, keys_path, log, *args) as srv:
            rounds = []
            for rnd in range(5):
                for i in range(8):
                    n = 8 * rnd + i
                    ids = [1000 + (n * 37 + j) % 1000 for j in range(100)]
                    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
                    post(srv.url, key("a"), {**body, "cache_ttl_s": ttl, "cache_salt": f"a{n}"})
                cached = 0
                for ids in system:
                    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
                    cached += post(srv.url, key("b"), body)["meta_info"]["cached_tokens"]
                rounds.append(cached)
            held = get(srv.url, key("a"), "/cache_pressure")["held_blocks"]
        print(f"| {name} | {', '.join(map(str, rounds))} | {held} |")


def starvation(model: str, keys_path: str, log: str, timeout_s: float, repeats: int) -> None:
    configs = [
        ("`priority_max_wait_s` 10 (default)", []),
        ("0 (aging by steps only)", ["--priority-max-wait-s", "0"]),
    ]
    print(
        "| setting | priorities | low request's first token s | its end s | flood done meanwhile |"
    )
    print("|---|---|---|---|---|")
    for (name, args), tenant in itertools.product(configs, RANGES):
        r = RANGES[tenant]
        runs = []
        with serve(model, keys_path, log, *args) as srv:
            for _ in range(repeats):
                runs.append(_starve_once(srv.url, tenant, timeout_s))
        shown = [
            ", ".join(f"> {timeout_s:.0f}" if x is None else f"{x:.1f}" for x in column)
            for column in list(zip(*runs))[:2]
        ]
        shown += [", ".join(str(run[2]) for run in runs)]
        print(f"| {name} | -{r}..{r} | {' | '.join(shown)} |")


def _starve_once(url: str, tenant: str, timeout_s: float) -> tuple:
    """(first token s, end s, flood requests done meanwhile) of one low request sent 5 s
    into a flood."""
    stop, done = threading.Event(), [0]
    threads = [
        threading.Thread(target=_flood, args=(url, tenant, t, stop, done), daemon=True)
        for t in range(24)
    ]
    for th in threads:
        th.start()
    time.sleep(5)  # the pool fills and requests queue
    before = done[0]
    first, end = _timed_stream(url, tenant, timeout_s)
    flood_done = done[0] - before
    stop.set()
    for th in threads:
        th.join(timeout=300)
    return first, end, flood_done


def _flood(url: str, tenant: str, t: int, stop: threading.Event, done: list[int]) -> None:
    """Thread `t` of the flood: one request of `tenant` at its most urgent priority after
    another until `stop`."""
    priority = -RANGES[tenant]
    n = 0
    while not stop.is_set():
        ids = [300 + (t * 97 + n * 13 + j) % 1500 for j in range(FLOOD_PROMPT)]
        sp = {"max_new_tokens": FLOOD_OUTPUT, "ignore_eos": True, "temperature": 0}
        try:
            post(url, key(tenant), {"input_ids": ids, "sampling_params": sp, "priority": priority})
        except OSError:
            return
        done[0] += 1
        n += 1


def _timed_stream(url: str, tenant: str, timeout_s: float) -> tuple[float | None, float | None]:
    """(seconds to the first token, to the end) of a streamed request of `tenant` at its
    least urgent priority (None: not within `timeout_s`)."""
    sp = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}
    body = {"input_ids": [7] * 50, "sampling_params": sp, "stream": True}
    body["priority"] = RANGES[tenant]
    req = urllib.request.Request(
        url + "/generate",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {key(tenant)}"},
    )
    start, first = time.monotonic(), None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            for line in resp:
                data = line.startswith(b"data:") and b"[DONE]" not in line
                if data and first is None and json.loads(line[5:])["output_ids"]:
                    first = time.monotonic() - start
            return first, time.monotonic() - start
    except (TimeoutError, urllib.error.URLError):  # no token for timeout_s
        return first, None


def main() -> None:
    from radixrt.model.tiny import ensure_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="retention,starvation")
    ap.add_argument("--model", default=None, help="default: the tiny model")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="the low request's")
    ap.add_argument("--repeats", type=int, default=3, help="low requests per starvation row")
    args = ap.parse_args()
    model = args.model or ensure_tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        keys_path = os.path.join(tmp, "keys")
        with open(keys_path, "w") as f:
            f.write(KEYS)
        log = os.path.join(tmp, "serve.log")
        scenarios = args.scenario.split(",")
        if "retention" in scenarios:
            retention(model, keys_path, log)
        if "starvation" in scenarios:
            starvation(model, keys_path, log, args.timeout_s, args.repeats)


if __name__ == "__main__":
    main()
