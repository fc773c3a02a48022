"""HTTP client processes of the front-capacity benchmark (benchmarks.bench_front).

Each process (`client_main`) keeps one aiohttp session and runs jobs sent over a pipe: a job
is a set of streams, each one streaming request (POST /generate, or /v1/completions with
stream=true), all started at once. Per stream it records the arrival time
(time.perf_counter: CLOCK_MONOTONIC, comparable across processes) and the tokens of every
SSE event, and the received token ids and text; per job, its own CPU time
(time.process_time) and wall time.

Two ways to read a stream:
- "chunks" (default, cheap): each read of the socket is split into events by hand and
  decoded with msgspec into the two fields used; every event of one read shares its time.
- "lines": `async for line in resp.content` and json.loads per event, as
  benchmarks/http_driver.py (bench_serving's client) does; a time per line.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import aiohttp
import msgspec

ROUTES = ("/generate", "/v1/completions")
PARSERS = ("chunks", "lines")
STREAM_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ClientJob:
    url: str
    streams: list[int]  # stream indices
    prompts: list[list[int]]  # their prompts (TokenSource.prompt_ids)
    max_tokens: int
    route: str = "/generate"
    parse: str = "chunks"
    stop: list[str] = field(default_factory=list)  # stop strings sent with each request


@dataclass
class StreamResult:
    stream: int
    event_times: list[float]  # arrival of each event that carried tokens or text
    # tokens per event (/generate); None for /v1/completions, whose chunks carry text only
    event_tokens: list[int] | None
    output_ids: list[int]  # /generate: every id received, in order ([] for completions)
    text: str  # the text received, concatenated
    completion_tokens: int  # /generate: len(output_ids); completions: the usage chunk's
    finish_reason: str | None
    done: bool  # the [DONE] line arrived


@dataclass
class ClientResult:
    streams: list[StreamResult]
    cpu_s: float  # this process's CPU time during the job
    wall_s: float
    pid: int


class _GenEvent(msgspec.Struct):
    text: str = ""
    output_ids: list[int] = []
    meta_info: dict = {}


class _Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None


class _CmplEvent(msgspec.Struct):
    choices: list[_Choice] = []
    usage: dict | None = None


def client_main(conn: Connection, cpus: tuple[int, ...] | None) -> None:
    """Run jobs from `conn` until it sends None; answer each with a ClientResult."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    asyncio.run(_serve_jobs(conn))


async def _serve_jobs(conn: Connection) -> None:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        loop = asyncio.get_running_loop()
        conn.send("ready")
        while True:
            job = await loop.run_in_executor(None, conn.recv)
            if job is None:
                return
            conn.send(await run_job(http, job))


async def run_job(http: aiohttp.ClientSession, job: ClientJob) -> ClientResult:
    if job.route not in ROUTES or job.parse not in PARSERS:
        raise ValueError(f"route must be one of {ROUTES} and parse one of {PARSERS}")
    cpu0, t0 = time.process_time(), time.perf_counter()
    streams = await asyncio.gather(
        *(_stream(http, job, i, p) for i, p in zip(job.streams, job.prompts, strict=True))
    )
    return ClientResult(
        list(streams), time.process_time() - cpu0, time.perf_counter() - t0, os.getpid()
    )


def _body(job: ClientJob, prompt: list[int]) -> dict:
    if job.route == "/generate":
        sp = {"max_new_tokens": job.max_tokens, "temperature": 0, "ignore_eos": True}
        if job.stop:
            sp["stop"] = job.stop
        return {"input_ids": prompt, "sampling_params": sp, "stream": True}
    body = {
        "prompt": prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if job.stop:
        body["stop"] = job.stop
    return body


async def _stream(
    http: aiohttp.ClientSession, job: ClientJob, stream: int, prompt: list[int]
) -> StreamResult:
    gen = job.route == "/generate"
    res = StreamResult(stream, [], [] if gen else None, [], "", 0, None, False)
    texts: list[str] = []
    async with http.post(job.url + job.route, json=_body(job, prompt)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{job.route} answered {resp.status}: {await resp.text()}")
        if job.parse == "chunks":
            buf = b""
            async for chunk in resp.content.iter_any():
                t = time.perf_counter()
                *events, buf = (buf + chunk).split(b"\n\n")
                for ev in events:
                    _on_event(res, texts, ev.removeprefix(b"data: "), t, gen)
        else:
            async for line in resp.content:
                t = time.perf_counter()
                if line.startswith(b"data: "):
                    _on_event(res, texts, line[6:].strip(), t, gen, json.loads)
    res.text = "".join(texts)
    if gen:
        res.completion_tokens = len(res.output_ids)
    return res


_gen_decoder = msgspec.json.Decoder(_GenEvent)
_cmpl_decoder = msgspec.json.Decoder(_CmplEvent)


def _on_event(
    res: StreamResult, texts: list[str], payload: bytes, t: float, gen: bool, loads=None
) -> None:
    if payload == b"[DONE]":
        res.done = True
        return
    if gen:
        ev = _gen_decoder.decode(payload) if loads is None else _GenEvent(**_pick(loads(payload)))
        if ev.output_ids or ev.text:
            res.event_times.append(t)
            res.event_tokens.append(len(ev.output_ids))  # type: ignore[union-attr]
            res.output_ids += ev.output_ids
            texts.append(ev.text)
        reason = (ev.meta_info.get("finish_reason") or {}).get("type")
        res.finish_reason = reason or res.finish_reason
        return
    obj = _cmpl_decoder.decode(payload) if loads is None else _cmpl_from(loads(payload))
    if obj.usage is not None:
        res.completion_tokens = obj.usage["completion_tokens"]
    for c in obj.choices:
        if c.text:
            res.event_times.append(t)
            texts.append(c.text)
        res.finish_reason = c.finish_reason or res.finish_reason


def _pick(obj: dict) -> dict:
    return {k: obj[k] for k in ("text", "output_ids", "meta_info") if k in obj}


def _cmpl_from(obj: dict) -> _CmplEvent:
    choices = [_Choice(c.get("text", ""), c.get("finish_reason")) for c in obj.get("choices", [])]
    return _CmplEvent(choices, obj.get("usage"))
