"""Soak test (not in CI): many requests against a live server with random aborts and
client disconnects; reports throughput, errors by kind, and leaks.

    python -m benchmarks.soak                       # tiny model, CPU, modest defaults
    python -m benchmarks.soak --requests 5000 --concurrency 32 --abort-rate 0.1 \\
        --disconnect-rate 0.1 --serve-args "--device cpu --num-kv-blocks 256"
    python -m benchmarks.soak --url http://127.0.0.1:30000   # a running server (with
                                                             # --enable-debug-endpoints)
    python -m benchmarks.soak --mix full --tenants --dp 2 --duration-s 600   # issue 47's

Requests mix the three APIs (/generate streaming, /v1/completions streaming or not,
/v1/chat/completions), short prompts and long ones that share a few prefixes (the radix
cache's case). A fraction is aborted through POST /abort after the first streamed event,
another fraction is dropped by the client mid-stream. `--mix full` adds tool calls
(`tool_choice` auto, required and named), JSON-schema and regex constrained requests, n > 1
and /generate beam search; a finished call whose arguments (or a finished JSON-schema answer)
do not parse counts as `bad_output`. `--tenants` writes an `--api-keys-file` (two tenants and
an admin key) and sends each request under one tenant's key; `--dp N` starts `radixrt serve
--dp N` and reads each replica's /debug/state on its own port.

Reported: requests/s and output tokens/s, outcomes by kind of request, 5xx (and in-stream
errors) by route, leaks once idle (in flight and KV blocks in use, per replica with --dp: all
must be 0) and the RSS of every server process (front, router, replicas, schedulers) before
and after.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import shlex
import tempfile
import time
import urllib.request
from collections import Counter
from typing import Any

import aiohttp

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima", "Pune"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "clock",
            "description": "the time in a zone",
            "parameters": {
                "type": "object",
                "properties": {
                    "tz": {"type": "string", "maxLength": 8},
                    "h24": {"type": "boolean"},
                },
                "required": ["tz"],
            },
        },
    },
]
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        },
        "required": ["name", "tags"],
    },
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
]
REGEXES = ["(yes|no)", "[a-z]{1,6}", r"\d{1,4}-\d{1,2}", "(red|green|blue)( and (red|green))?"]
# kinds of request in --mix full beyond the three APIs (each as likely as one API)
FULL_KINDS = ("tools_auto", "tools_required", "tools_named", "json_schema", "regex", "n", "beam")
TENANT_NAMES = ("tenant-a", "tenant-b")
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


def get_json(url: str, key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def write_keys_file(path: str, seed: int) -> dict[str, str]:
    """Two tenants' keys and an admin key (tenant name or "admin" -> key), written to `path`
    as `--api-keys-file` reads it."""
    rng = random.Random(seed)
    keys = {t: f"soak-{t}-{rng.getrandbits(64):016x}" for t in (*TENANT_NAMES, "admin")}
    with open(path, "w") as f:
        f.write("# written by benchmarks/soak.py\n")
        for t in TENANT_NAMES:
            f.write(f"{keys[t]} {t}\n")
        f.write(f"{keys['admin']} ops admin\n")
    os.chmod(path, 0o600)
    return keys


def make_prompt(rng: random.Random, prefixes: list[str], long_fraction: float) -> str:
    tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
    if rng.random() < long_fraction:
        return rng.choice(prefixes) + " " + tail
    return tail


def build(
    rng: random.Random, args: argparse.Namespace, prefixes: list[str], rid: str
) -> tuple[str, str, dict[str, Any], bool, bool, bool]:
    """(kind, path, body, stream, abort, disconnect) of one request."""
    prompt = make_prompt(rng, prefixes, args.long_fraction)
    max_tokens = rng.randint(1, args.max_tokens)
    fate = rng.random()
    abort = fate < args.abort_rate
    disconnect = not abort and fate < args.abort_rate + args.disconnect_rate
    kinds = ["generate", "completions", "chat"]
    if args.mix == "full":
        kinds += FULL_KINDS
    kind = "generate" if abort else rng.choice(kinds)
    stream = abort or disconnect or rng.random() < 0.5
    chat_body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
    if kind == "generate":
        path = "/generate"
        sp = {"max_new_tokens": max_tokens, "temperature": rng.choice([0, 0.8])}
        body: dict[str, Any] = {"text": prompt, "sampling_params": sp, "rid": rid}
    elif kind == "completions":
        path = "/v1/completions"
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8}
    elif kind == "chat":
        path = "/v1/chat/completions"
        body = {**chat_body, "max_tokens": max_tokens}
    elif kind.startswith("tools_"):
        path = "/v1/chat/completions"
        choice: Any = kind.removeprefix("tools_")
        if choice == "named":
            choice = {
                "type": "function",
                "function": {"name": rng.choice(TOOLS)["function"]["name"]},
            }
        body = {**chat_body, "tools": TOOLS, "tool_choice": choice, "max_tokens": 64}
        body["temperature"] = rng.choice([0, 1.0])
        body["parallel_tool_calls"] = rng.random() < 0.5
    elif kind == "json_schema":
        path = "/v1/chat/completions"
        fmt = {"name": "out", "schema": rng.choice(SCHEMAS)}
        body = {**chat_body, "response_format": {"type": "json_schema", "json_schema": fmt}}
        body.update(max_tokens=64, temperature=rng.choice([0, 1.0]))
    elif kind == "regex":
        path = "/generate"
        sp = {"max_new_tokens": 24, "temperature": 1.0, "regex": rng.choice(REGEXES)}
        body = {"text": prompt, "sampling_params": sp, "rid": rid}
    elif kind == "n":
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        body = {"prompt": prompt} if path == "/v1/completions" else dict(chat_body)
        body.update(n=rng.choice([2, 3]), max_tokens=max_tokens, temperature=0.8)
    else:  # beam: not streamed (the beams are ranked at the end)
        path, stream = "/generate", False
        sp = {"max_new_tokens": max_tokens, "beam_width": rng.choice([2, 3])}
        body = {"text": prompt, "sampling_params": sp, "rid": rid}
    body["stream"] = stream
    if stream and path != "/generate":
        body["stream_options"] = {"include_usage": True}
    return kind, path, body, stream, abort, disconnect


def bad_output(kind: str, out: Any) -> bool:
    """A finished tool call whose arguments, or a finished JSON-schema answer, do not parse."""
    if kind.startswith("tools_") or kind == "json_schema":
        for choice in out.get("choices", []):
            msg = choice.get("message") or {}
            try:
                for call in msg.get("tool_calls") or []:
                    json.loads(call["function"]["arguments"])
                if kind == "json_schema" and choice.get("finish_reason") == "stop":
                    json.loads(msg.get("content") or "")
            except (ValueError, KeyError, TypeError):
                return True
    return False


async def one(
    http: aiohttp.ClientSession,
    url: str,
    i: int,
    rng: random.Random,
    args: argparse.Namespace,
    prefixes: list[str],
    key: str | None = None,
) -> tuple[str, str, str, int]:
    """(kind, route, outcome, output tokens) of one request."""
    rid = f"soak-{args.seed}-{i}"
    kind, path, body, stream, abort, disconnect = build(rng, args, prefixes, rid)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    try:
        async with http.post(url + path, json=body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                return kind, path, f"http_{resp.status}", 0
            if not stream:
                out = await resp.json()
                if path == "/generate":
                    outs = out if isinstance(out, list) else [out]
                    n = sum(o["meta_info"]["completion_tokens"] for o in outs)
                else:
                    n = out["usage"]["completion_tokens"]
                return kind, path, ("bad_output" if bad_output(kind, out) else "ok"), n
            tokens, events = 0, 0
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return kind, path, "stream_error", tokens
                events += 1
                if path == "/generate":
                    tokens = event["meta_info"]["completion_tokens"]  # so far (any stream mode)
                elif event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if events == 1 and abort:
                    async with http.post(url + "/abort", json={"rid": rid}, headers=headers) as a:
                        await a.read()
                if events == 1 and disconnect:
                    resp.close()  # drop the connection mid-stream
                    return kind, path, "disconnected", tokens
            return kind, path, ("aborted" if abort else "ok"), tokens
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return kind, path, type(e).__name__, 0


async def drive(
    url: str,
    args: argparse.Namespace,
    keys: dict[str, str] | None = None,
    pids: dict[str, int | None] | None = None,
) -> dict[str, Any]:
    """`args.requests` requests, or as many as `args.duration_s` allows when it is set; the
    RSS of `pids` every `args.rss_every_s` meanwhile (growth late in a run is a leak's sign)."""
    rng = random.Random(args.seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(4)]
    outcomes: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {}
    errors_by_route: Counter[str] = Counter()  # 5xx and in-stream errors
    tokens = 0
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    duration = getattr(args, "duration_s", None)
    counter = itertools.count()
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0 = time.perf_counter()

        async def worker() -> None:
            nonlocal tokens
            while True:
                i = next(counter)
                if duration is None and i >= args.requests:
                    return
                if duration is not None and time.perf_counter() - t0 > duration:
                    return
                r = random.Random(f"{args.seed}-{i}")
                key = keys[TENANT_NAMES[i % len(TENANT_NAMES)]] if keys else None
                kind, route, outcome, n = await one(http, url, i, r, args, prefixes, key)
                outcomes[outcome] += 1
                by_kind.setdefault(kind, Counter())[outcome] += 1
                if outcome.startswith("http_5") or outcome == "stream_error":
                    errors_by_route[f"{route} {outcome}"] += 1
                tokens += n

        rss_samples: list[dict[str, Any]] = []

        async def sample_rss() -> None:
            while True:
                await asyncio.sleep(args.rss_every_s)
                at = round(time.perf_counter() - t0)
                rss_samples.append({"t_s": at, **{n: rss_mb(p) for n, p in (pids or {}).items()}})

        sampler = asyncio.create_task(sample_rss())
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        sampler.cancel()
        elapsed = time.perf_counter() - t0
    return {
        "elapsed_s": elapsed,
        "requests": sum(outcomes.values()),
        "outcomes": dict(outcomes),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "5xx_by_route": dict(errors_by_route),
        "output_tokens": tokens,
        "rss_mb_samples": rss_samples,
    }


def wait_idle(url: str, key: str | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        st = get_json(url + "/debug/state", key)
        snap = st["scheduler"] or {}
        idle = st["in_flight"] == 0 and not snap.get("running") and not snap.get("waiting")
        if (idle and not snap.get("kv_blocks_in_use")) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def dp_processes(log_path: str) -> tuple[dict[str, int], list[str]]:
    """The router's and the replicas' pids and the replicas' URLs, from `serve --dp`'s log
    (the latest line per replica: a restarted one has a new pid)."""
    pids: dict[str, int] = {}
    urls: dict[int, str] = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            if m := re.search(r"replica (\d+): (http://\S+) \(pid (\d+)", line):
                pids[f"replica{m[1]}"] = int(m[3])
                urls[int(m[1])] = m[2]
            elif m := re.search(r"router started \(pid (\d+)", line):
                pids["router"] = int(m[1])
    return pids, [urls[i] for i in sorted(urls)]


def snapshot(
    state_urls: list[str], pids: dict[str, int | None], key: str | None
) -> tuple[list[dict[str, Any]], dict[str, int | None]]:
    """Each debug-state URL's state once idle, and every process's pid (schedulers added)."""
    states = [wait_idle(u, key) for u in state_urls]
    pids = dict(pids)
    for i, st in enumerate(states):
        pids[f"scheduler{i}" if len(states) > 1 else "scheduler"] = st.get("scheduler_pid")
    return states, pids


def soak(
    url: str,
    front_pid: int | None,
    args: argparse.Namespace,
    keys: dict[str, str] | None = None,
    log_path: str | None = None,
) -> dict[str, Any]:
    admin = keys["admin"] if keys else None
    warm = argparse.Namespace(
        **{**vars(args), "requests": 8, "abort_rate": 0.0, "duration_s": None}
    )
    asyncio.run(drive(url, warm, keys))
    pids: dict[str, int | None] = {"front": front_pid}
    state_urls = [url]
    if args.dp and log_path is not None:
        dp_pids, state_urls = dp_processes(log_path)
        pids.update(dp_pids)
    states, pids = snapshot(state_urls, pids, admin)
    rss_before = {name: rss_mb(pid) for name, pid in pids.items()}
    result = asyncio.run(drive(url, args, keys, pids))
    if args.dp and log_path is not None:
        dp_pids, state_urls = dp_processes(log_path)
        pids.update(dp_pids)
    after, pids_after = snapshot(state_urls, pids, admin)
    restarted = sorted(n for n, pid in pids_after.items() if pids.get(n) != pid)
    leaks = []
    for st in after:
        snap = st["scheduler"] or {}
        leaks.append(
            {
                "in_flight": st["in_flight"],
                "kv_blocks_in_use": snap.get("kv_blocks_in_use"),
                "integrity_error": snap.get("integrity_error"),
                "serving": st["serving"],
            }
        )
    outcomes = result["outcomes"]
    done = sum(n for k, n in outcomes.items() if k in ("ok", "aborted", "disconnected"))
    return {
        **result,
        "requests_per_s": done / result["elapsed_s"],
        "output_tokens_per_s": result["output_tokens"] / result["elapsed_s"],
        "leaks": leaks[0] if len(leaks) == 1 else leaks,
        "restarted_processes": restarted,
        "rss_mb_before": rss_before,
        "rss_mb_after": {name: rss_mb(pid) for name, pid in pids_after.items()},
    }


def leaked(report: dict[str, Any]) -> bool:
    leaks = report["leaks"]
    return any(
        r["in_flight"] or r["kv_blocks_in_use"] or r["integrity_error"]
        for r in (leaks if isinstance(leaks, list) else [leaks])
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--front-pid", type=int, default=None, help="with --url: for its RSS")
    p.add_argument("--model", default=None, help="model dir for the started server (tiny)")
    p.add_argument("--serve-args", default="--device cpu --dtype float32")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--duration-s", type=float, default=None, help="run this long (not --requests)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rss-every-s", type=float, default=60.0, help="RSS samples while running")
    p.add_argument("--mix", choices=["basic", "full"], default="basic")
    p.add_argument("--tenants", action="store_true", help="an --api-keys-file, two tenants")
    p.add_argument("--dp", type=int, default=0, help="start `radixrt serve --dp N`")
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
        if args.tenants or args.dp:
            p.error("--tenants and --dp start their own server (no --url)")
        report = soak(args.url.rstrip("/"), args.front_pid, args)
    else:
        from benchmarks.http_driver import ServerProcess
        from radixrt.model.tiny import ensure_tiny_model

        tmp = tempfile.mkdtemp(prefix="radixrt-soak-")
        log = os.path.join(tmp, "server.log")
        model = args.model or ensure_tiny_model()
        serve_args = shlex.split(args.serve_args)
        keys = None
        if args.tenants:
            keys = write_keys_file(os.path.join(tmp, "keys"), args.seed)
            serve_args += ["--api-keys-file", os.path.join(tmp, "keys")]
        if args.dp:
            serve_args += ["--dp", str(args.dp)]
        with ServerProcess(model, serve_args, log) as server:
            report = soak(server.url, server.proc.pid, args, keys, log)
        report["server_log"] = log
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if leaked(report):
        raise SystemExit("LEAK: the server holds state after the soak (see 'leaks')")
    if report["5xx_by_route"]:
        raise SystemExit("5xx: see '5xx_by_route'")


if __name__ == "__main__":
    main()
