"""Drive a live `radixrt serve` through its native streaming POST /generate (aiohttp).

`ServerProcess` starts one server per configuration and stops it; `run_server` sends a
workload's calls as they become ready and times the streamed tokens. KV figures come from
polling GET /metrics (radixrt_kv_blocks_*) and, when the server runs with
--enable-debug-endpoints, preemptions and steps from GET /debug/state.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

import aiohttp
import msgspec

from benchmarks.dispatch import Dispatcher, ReadyCall
from benchmarks.metrics import CallRecord, DriverResult, KVStats
from benchmarks.workloads import Workload

METRICS_POLL_S = 0.1
_json_decode = msgspec.json.Decoder().decode


class ServerProcess:
    """`python -m radixrt.cli serve --model MODEL --port P <serve_args>` as a child process.

    Use as a context manager: entering waits until GET /health answers 200 (raises
    RuntimeError with the log's tail if the process exits or `startup_timeout_s` passes);
    leaving sends SIGTERM and waits (SIGKILL after 30 s). Output goes to `log_path`."""

    def __init__(
        self,
        model: str,
        serve_args: Sequence[str],
        log_path: str,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.model = model
        self.serve_args = list(serve_args)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "radixrt.cli", "serve", "--model", self.model]
        cmd += ["--port", str(self.port), "--enable-debug-endpoints", *self.serve_args]
        env = dict(os.environ)
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(
                    f"server did not become healthy (exit code {self.proc.returncode}); "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False  # not listening yet, or 503 while loading


def run_server(
    base_url: str,
    workload: Workload,
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    timeout_s: float | None = None,
    on_call_done: Callable[[], None] | None = None,
    server_stats: bool = True,
) -> DriverResult:
    """Run every call of `workload` against the server at `base_url` (idle); see
    `Dispatcher` for ordering, concurrency and pacing. On timeout the calls in flight are
    cancelled (the server aborts them) and the result is marked incomplete. `server_stats`
    False: no GET /metrics or /debug/state at `base_url` (a router in front of replicas,
    which has neither); the result's KV figures stay None."""
    return asyncio.run(
        _run(
            base_url, workload, max_concurrency, request_rate, seed, timeout_s, on_call_done,
            server_stats,
        )
    )  # fmt: skip


async def _run(
    base_url: str,
    workload: Workload,
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    timeout_s: float | None,
    on_done: Callable[[], None] | None,
    server_stats: bool,
) -> DriverResult:
    disp = Dispatcher(workload, max_concurrency, request_rate, seed)
    # This process holds torch and the workloads (millions of objects): frozen, the
    # collector's full passes stop pausing the reading of every stream for ~0.1 s.
    gc.collect()
    gc.freeze()
    cpu_start = time.process_time()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base_url, connector=connector) as http:
        before = await _debug_state(http) if server_stats else None
        kv = KVStats()
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_metrics(http, kv, stop) if server_stats else stop.wait())
        tasks: dict[asyncio.Task, ReadyCall] = {}
        records: list[CallRecord] = []
        complete = True
        start = time.perf_counter()
        try:
            while not disp.done:
                now = time.perf_counter() - start
                if timeout_s is not None and now > timeout_s:
                    complete = False
                    break
                for call in disp.pop_ready(now):
                    tasks[asyncio.create_task(_send(http, call, start))] = call
                nxt = disp.next_arrival()
                wait = None if nxt is None else max(0.0, nxt - now)
                if timeout_s is not None:
                    wait = max(0.0, min(wait if wait is not None else math.inf, timeout_s - now))
                if not tasks:  # every program left waits for its arrival time
                    assert wait is not None, "nothing in flight, nothing ready, programs left"
                    await asyncio.sleep(wait)
                    continue
                done, _ = await asyncio.wait(
                    tasks, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    call = tasks.pop(task)
                    rec, output_ids = task.result()
                    records.append(rec)
                    disp.finish(call, output_ids, time.perf_counter() - start)
                    if on_done is not None:
                        on_done()
            duration = time.perf_counter() - start
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            stop.set()
            await poller
        after = await _debug_state(http) if server_stats else None
    if before is not None and after is not None:
        kv.preemptions = after["preemptions"] - before["preemptions"]
        kv.steps = after["steps"] - before["steps"]
    client_cpu = time.process_time() - cpu_start
    gc.unfreeze()
    return DriverResult(records, duration, kv, complete, client_cpu)


async def _send(
    http: aiohttp.ClientSession, call: ReadyCall, start: float
) -> tuple[CallRecord, list[int]]:
    body = {
        "input_ids": call.prompt,
        "sampling_params": {
            "max_new_tokens": call.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        "stream": True,
    }
    submit = time.perf_counter() - start
    output_ids: list[int] = []
    token_times: list[float] = []
    meta: dict = {}
    async with http.post("/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"POST /generate: HTTP {resp.status}: {await resp.text()}")
        # whole chunks, not lines: one timestamp per read, events split and decoded
        # with msgspec (the client's cost per token stays small next to the server's)
        buf = b""
        async for data in resp.content.iter_any():
            t = time.perf_counter() - start
            *events, buf = (buf + data).split(b"\n\n")
            for raw in events:
                if not raw.startswith(b"data: "):
                    continue
                payload = raw[6:]
                if payload == b"[DONE]":
                    break
                event = _json_decode(payload)
                if "error" in event:
                    raise RuntimeError(f"POST /generate stream error: {event['error']}")
                meta = event["meta_info"]
                # SGLang's streams carry every id so far, --incremental-streaming-output's
                # the new ones: either way the last (count - seen) ids are new
                num_new = meta["completion_tokens"] - len(output_ids)
                if num_new > 0:
                    output_ids += event["output_ids"][-num_new:]
                    token_times += [t] * num_new
    end = time.perf_counter() - start
    if not meta or meta.get("finish_reason") is None:
        raise RuntimeError(f"stream of program {call.program} call {call.index} did not finish")
    rec = CallRecord(
        prompt_tokens=meta["prompt_tokens"],
        cached_tokens=meta["cached_tokens"],
        output_tokens=len(output_ids),
        submit=submit,
        first_token=token_times[0] if token_times else end,
        end=end,
        token_times=token_times,
    )
    return rec, output_ids


async def _poll_metrics(http: aiohttp.ClientSession, kv: KVStats, stop: asyncio.Event) -> None:
    """Track the peaks of the KV gauges; polls once more after `stop` is set, then returns."""
    while True:
        async with http.get("/metrics") as resp:
            resp.raise_for_status()
            gauges = parse_prometheus(await resp.text())
        total = int(gauges["radixrt_kv_blocks_total"])
        used = total - int(gauges["radixrt_kv_blocks_free"])
        active = int(gauges["radixrt_kv_blocks_in_use"])
        kv.blocks_total = total
        kv.peak_blocks_used = max(kv.peak_blocks_used or 0, used)
        kv.peak_blocks_active = max(kv.peak_blocks_active or 0, active)
        if stop.is_set():
            return
        await asyncio.sleep(METRICS_POLL_S)


async def _debug_state(http: aiohttp.ClientSession) -> dict | None:
    """The scheduler snapshot from GET /debug/state (zero counters before the first step);
    None when the server runs without --enable-debug-endpoints."""
    async with http.get("/debug/state") as resp:
        if resp.status == 404:
            return None
        resp.raise_for_status()
        snap = (await resp.json())["scheduler"] or {"preemptions": 0, "steps": 0}
    if snap.get("integrity_error"):
        raise RuntimeError(f"server integrity check failed: {snap['integrity_error']}")
    return snap


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, `name{labels}` -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])
