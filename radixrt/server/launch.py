"""`radixrt serve`: start the scheduler process and the HTTP front, stop both cleanly.

Process model: this (front) process listens on the HTTP port first (a taken port is a
one-line error and exit code 1 at once) and answers /health with 503 "loading" from then
on; it binds two ipc:// sockets in a private temp dir, loads the tokenizer (without
torch: the front never imports it), and spawns the scheduler process ("spawn" context,
daemon child). Once the scheduler's Ready arrives it serves, and removes the temp dir
(both ends are connected). SIGINT/SIGTERM: stop accepting, fail in-flight requests with
503, close HTTP, send Shutdown, join the child (terminate/kill if it lingers). The child
exits by itself if this process dies.

While serving, the front watches the scheduler's progress (`liveness`: 503 while it has
work and is silent past --stall-timeout) and its own HTTP connections (`connections`:
read deadlines, idle timeout, a cap below the open-file limit, which it raises to the
hard limit at start).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import multiprocessing
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import zmq
from aiohttp import web

from radixrt.config import ModelConfig, resolve_config
from radixrt.hf_dir import check_model_dir, load_tokenizer, resolve_model
from radixrt.hf_dir.smollm2 import fetch_default_model
from radixrt.lora import LoraRegistry
from radixrt.server.channel import Channel, MsgpackCodec
from radixrt.server.connections import (
    ConnectionGuard,
    ConnectionLimits,
    GuardedSite,
    connection_cap,
    raise_fd_limit,
)
from radixrt.server.front import Front
from radixrt.server.http_api import create_app
from radixrt.server.kv_publisher import KVEventsConfig
from radixrt.server.liveness import StallPolicy
from radixrt.server.messages import FromScheduler, Shutdown, ToScheduler
from radixrt.server.metrics import ServerMetrics
from radixrt.server.scheduler_process import SchedulerProcessArgs, scheduler_main
from radixrt.server.serve_config import EVENT_LOOPS, ServeConfig
from radixrt.server.tenants import ENV_VAR, Tenants
from radixrt.server.tools import TOOL_PARSERS
from radixrt.server.worker_routes import WorkerInfo
from radixrt.token_bytes import TokenBytes

logger = logging.getLogger("radixrt.server")

SHUTDOWN_TIMEOUT_S = 5.0  # HTTP handlers, then the child, get this long each to finish


def event_loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The front's loop: uvloop (libuv transports and callbacks: the per-stream writes of
    streaming cost less) when installed, else asyncio's; None: asyncio's default."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            msg = "event_loop 'uvloop' needs the uvloop package (pip install uvloop)"
            raise ValueError(msg) from None
        return None
    return uvloop.new_event_loop


# starts the scheduler process: (config, EOS ids, front->scheduler, scheduler->front) -> process
SchedulerStarter = Callable[
    [ServeConfig, list[int], Channel[ToScheduler], Channel[FromScheduler]],
    multiprocessing.process.BaseProcess,
]


# run in a child process: the front imports no torch (the tiny model's code does)
_TINY_MODEL_SCRIPT = """
import sys
from radixrt.model.tiny import TINY_MODEL_LINE, ensure_tiny_model, tiny_model_ready
what = ("serving the tiny model" if tiny_model_ready() else
        "training the tiny model on first use (1-2 minutes on a core), then serving it")
print(f"no --model: {what}, {TINY_MODEL_LINE}", file=sys.stderr, flush=True)
print(ensure_tiny_model())
"""


def _tiny_model() -> str:
    """The embedded tiny model's dir (`radixrt serve` without --model), trained first if this
    machine has no copy yet; says so either way (on stderr). Raises CalledProcessError if it
    cannot be built."""
    out = subprocess.run(
        [sys.executable, "-c", _TINY_MODEL_SCRIPT], stdout=subprocess.PIPE, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def _served_model(args: argparse.Namespace) -> tuple[str, str | None]:
    """(the model dir to serve, the id to serve it as; None: that dir): --model resolved
    (GGUF files and hub ids), else SmolLM2, else (--tiny, or SmolLM2 cannot be fetched) the
    tiny model."""
    spec = args.model
    if spec is None and not args.tiny:
        spec = fetch_default_model()
    if spec is None:
        return _tiny_model(), None
    model = resolve_model(spec, tokenizer=args.tokenizer, revision=args.revision)
    return model, None if model == spec else spec


def add_serve_command(
    subparsers: argparse._SubParsersAction,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
    engine_options: Callable[[argparse.Namespace], dict],
) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument(
        "--model",
        default=None,
        help="an HF dir, a .gguf file (or a dir holding one) or a hub id org/name (default: "
        "SmolLM2-135M-Instruct, fetched once, ~100 MB)",
    )
    p.add_argument(
        "--tiny", action="store_true", help="no --model: the embedded tiny model (trained once)"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument(
        "--api-keys-file",
        default=None,
        help="'KEY TENANT' lines: each key's requests share cached KV only within its tenant "
        f"(or set ${ENV_VAR}; see radixrt.server.tenants)",
    )
    p.add_argument("--served-model-name", default=None, help="model id (default: --model)")
    p.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="GET /debug/state (scheduler state, KV blocks) and integrity checks when idle",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch threads of the scheduler process on CPU (default: all cores but one)",
    )
    p.add_argument(
        "--event-loop",
        default="auto",
        choices=EVENT_LOOPS,
        help="the HTTP front's event loop (auto: uvloop when installed)",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=StallPolicy.timeout_s,
        help="seconds the scheduler may go without progress while it has work before /health "
        "answers 503 and requests fail with 503 (default: %(default)g; above the longest step)",
    )
    p.add_argument(
        "--stall-timeout-warmup",
        type=float,
        default=StallPolicy.warmup_timeout_s,
        help="the stall timeout until the first request finishes (first steps may compile "
        "kernels; default: %(default)g)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=ConnectionLimits.header_timeout_s,
        help="seconds from a request's first byte to the end of its headers; slower "
        "connections are closed (default: %(default)g)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=ConnectionLimits.body_timeout_s,
        help="seconds to receive a request body whole, else 408 (default: %(default)g)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=ConnectionLimits.keep_alive_timeout_s,
        help="seconds an idle connection stays open between requests (default: %(default)g)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=ConnectionLimits.max_connections,
        help="HTTP connections open at once; more are refused with 503 (default: "
        "%(default)d, at most the open-file limit less 128)",
    )
    p.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse request fields that no schema declares (default: ignore, warn once)",
    )
    p.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="/generate streams only the new text and ids per event (default: all so far, "
        "as SGLang)",
    )
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish KV cache events in vLLM's format on this ZMQ PUB address, bound (e.g. "
        "tcp://127.0.0.1:5557; default: off)",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ZMQ ROUTER address, bound, that replays buffered event batches from a sequence "
        "number (e.g. tcp://127.0.0.1:5558; default: none)",
    )
    p.add_argument(
        "--kv-events-token-ids",
        action="store_true",
        help="KV events carry each stored block's token ids (default: hashes only; refused "
        "with tenants: the events would show every tenant's prompts)",
    )
    p.add_argument(
        "--kv-events-allow-remote",
        action="store_true",
        help="the KV event addresses may be non-loopback (ZMQ has no authentication: anyone "
        "who reaches them reads the events)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", *TOOL_PARSERS],
        help="the format the model writes tool calls in (default auto: from the chat "
        "template, hermes when it names none)",
    )
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        help="replicas (one per GPU set on CUDA) behind sglang-router's cache_aware policy on "
        "--host:--port; needs the router extra: pip install 'radixrt[router]' (default: 1)",
    )
    p.add_argument(
        "--router-prometheus-port",
        type=int,
        default=None,
        help="--dp > 1: the router's Prometheus port, on 127.0.0.1 (clients read it as the "
        "endpoint's /metrics; default: a free one)",
    )
    p.add_argument(
        "--router-args",
        default="",
        help="--dp > 1: more sglang-router options, one string, after radixrt's "
        "'--cache-threshold 0.5 --balance-abs-threshold 8 --balance-rel-threshold 3' (e.g. "
        "'--balance-rel-threshold 2')",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(p)

    def run(args: argparse.Namespace) -> None:
        logging.basicConfig(
            level=args.log_level.upper(), format="%(asctime)s front %(levelname)s %(message)s"
        )
        options = engine_options(args)
        try:
            kv_events = None
            if args.kv_events_endpoint is not None:
                kv_events = KVEventsConfig(
                    args.kv_events_endpoint,
                    args.kv_events_replay_endpoint,
                    token_ids=args.kv_events_token_ids,
                    allow_remote=args.kv_events_allow_remote,
                )
                options["kv_events"] = True
            elif args.kv_events_replay_endpoint is not None:
                raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
            if args.dp < 1:
                raise ValueError(f"--dp must be at least 1, got {args.dp}")
            if args.dp > 1:
                from radixrt.server.dp import check_router

                check_router()
            model, name = _served_model(args)
            cfg = ServeConfig(
                model=model,
                host=args.host,
                port=args.port,
                api_key=args.api_key,
                tenants=Tenants.load(args.api_keys_file),
                served_model_name=args.served_model_name or name,
                debug_endpoints=args.enable_debug_endpoints,
                cpu_threads=args.cpu_threads,
                event_loop=args.event_loop,
                strict_fields=args.strict_fields,
                incremental_streaming=args.incremental_streaming_output,
                tool_call_parser=args.tool_call_parser,
                stall=StallPolicy(args.stall_timeout, args.stall_timeout_warmup),
                connections=ConnectionLimits(
                    header_timeout_s=args.header_timeout,
                    body_timeout_s=args.body_timeout,
                    keep_alive_timeout_s=args.keep_alive_timeout,
                    max_connections=args.max_connections,
                ),
                device=options.pop("device", "auto"),
                dtype=options.pop("dtype", "auto"),
                options=options,
                kv_events=kv_events,
            )
        except (ValueError, OSError) as e:  # OSError: an unreadable --api-keys-file
            p.error(str(e))
        if args.dp > 1:
            from radixrt.server.dp import DPOptions, serve_dp

            code = serve_dp(
                cfg,
                DPOptions(
                    args.dp,
                    args.router_prometheus_port,
                    shlex.split(args.router_args),
                    args.log_level,
                ),
            )
        else:
            code = serve(cfg)
        # Everything is released by now (child joined, sockets closed, temp dir gone);
        # skip the interpreter's finalization of torch/transformers (seconds on a busy box).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    p.set_defaults(func=run)


def serve(cfg: ServeConfig, start_scheduler: SchedulerStarter | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit code (1: it could not start:
    the port is taken, the model dir or an option is bad, or the scheduler process failed
    before it was ready). Order: listen first (a taken port fails at once, and /health
    answers 503 "loading" from then on), check the model dir, load the tokenizer, start
    the scheduler process; serve once it is Ready. `start_scheduler` replaces the real
    scheduler process (benchmarks.bench_front serves the real front with a fake one)."""
    try:
        max_connections = connection_cap(cfg.connections, raise_fd_limit())
    except ValueError as e:
        logger.error("cannot serve: %s", e)
        return 1
    try:
        sock = _listen(cfg.host, cfg.port)
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        logger.error("cannot listen on %s:%d: %s", cfg.host, cfg.port, reason)
        return 1
    try:
        check_model_dir(cfg.model, require_weights=cfg.options.get("load_format") != "dummy")
        resolve_config(cfg.model, cfg.device, cfg.dtype, detect_devices=False, **cfg.options)
        loras = _lora_registry(cfg)
        loop_factory = event_loop_factory(cfg.event_loop)
    except (OSError, ValueError) as e:
        sock.close()
        logger.error("cannot serve %s: %s", cfg.model, e)
        return 1
    ipc_dir = tempfile.mkdtemp(prefix="radixrt-ipc-")
    ctx = zmq.Context()
    to_scheduler: Channel[ToScheduler] = Channel(
        ctx, f"ipc://{ipc_dir}/to_scheduler", MsgpackCodec(ToScheduler), push=True, bind=True
    )
    from_scheduler: Channel[FromScheduler] = Channel(
        ctx, f"ipc://{ipc_dir}/from_scheduler", MsgpackCodec(FromScheduler), push=False, bind=True
    )
    try:
        start = start_scheduler or _start_scheduler
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            serving = _serve_http(
                cfg, sock, max_connections, ipc_dir, to_scheduler, from_scheduler, start, loras
            )
            return runner.run(serving)
    finally:
        to_scheduler.close()
        from_scheduler.close()
        ctx.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        logger.info("server stopped")


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (raises OSError: taken, or no such address)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


def _start_scheduler(
    cfg: ServeConfig,
    eos: list[int],
    to_scheduler: Channel[ToScheduler],
    from_scheduler: Channel[FromScheduler],
) -> multiprocessing.process.BaseProcess:
    args = SchedulerProcessArgs(
        model_path=cfg.model,
        device=cfg.device,
        dtype=cfg.dtype,
        eos_token_ids=eos,
        in_addr=to_scheduler.addr,
        out_addr=from_scheduler.addr,
        parent_pid=os.getpid(),
        options=dict(cfg.options),
        debug=cfg.debug_endpoints,
        cpu_threads=cfg.cpu_threads,
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        kv_events=cfg.kv_events,
    )
    proc = multiprocessing.get_context("spawn").Process(
        target=scheduler_main, args=(args,), name="radixrt-scheduler", daemon=True
    )
    proc.start()
    logger.info("scheduler process started (pid %d)", proc.pid)
    return proc


def _lora_registry(cfg: ServeConfig) -> LoraRegistry | None:
    """The front's LoRA adapters, `lora_modules` loaded (None: LoRA off). Raises ValueError
    (LoraLoadError) for an adapter it refuses."""
    lora = resolve_config(
        cfg.model, cfg.device, cfg.dtype, detect_devices=False, **cfg.options
    ).lora
    if not lora.enabled:
        return None
    registry = LoraRegistry(ModelConfig.from_pretrained(cfg.model), lora.max_lora_rank)
    for name, path in lora.modules():
        registry.load(name, path)
    return registry


async def _serve_http(
    cfg: ServeConfig,
    sock: socket.socket,
    max_connections: int,
    ipc_dir: str,
    to_scheduler: Channel[ToScheduler],
    from_scheduler: Channel[FromScheduler],
    start_scheduler: SchedulerStarter,
    loras: LoraRegistry | None = None,
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    model_name = cfg.served_model_name or cfg.model
    front = Front(
        None,
        to_scheduler,
        from_scheduler,
        ServerMetrics(),
        model_name,
        cfg.stall,
        cfg.tenants,
        loras,
    )
    front.start()
    limits = cfg.connections
    worker = WorkerInfo.of_model_dir(
        cfg.model, model_name, int(cfg.options.get("tensor_parallel_size", 1) or 1)
    )
    worker = replace(worker, kv_events=cfg.kv_events)
    app = create_app(
        front,
        model_name=model_name,
        api_key=cfg.api_key,
        tenants=cfg.tenants,
        debug=cfg.debug_endpoints,
        body_timeout_s=limits.body_timeout_s,
        worker=worker,
        strict_fields=cfg.strict_fields,
        incremental_streaming=cfg.incremental_streaming,
        tool_call_parser=cfg.tool_call_parser,
    )
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        **limits.handler_kwargs(),
    )
    await runner.setup()
    assert runner.server is not None
    guard = ConnectionGuard(runner.server, limits, max_connections, front.metrics)
    proc: multiprocessing.process.BaseProcess | None = None
    code = 0
    try:
        await GuardedSite(runner, sock, guard).start()
        logger.info(
            "listening on http://%s:%d (model %s, at most %d connections)",
            cfg.host, cfg.port, cfg.model, max_connections,
        )  # fmt: skip
        loading = loop.run_in_executor(None, _load_tokenizer, cfg.model)
        if not await _first(stop, loading):
            return 0
        loaded = loading.result()
        if loaded is None:
            return 1
        tokenizer, token_bytes = loaded
        eos = ModelConfig.from_pretrained(cfg.model).stop_token_ids(tokenizer.eos_token_id)
        proc = start_scheduler(cfg, eos, to_scheduler, from_scheduler)

        def on_child_exit() -> None:
            loop.remove_reader(proc.sentinel)
            proc.join(0)
            front.stop_serving(f"the scheduler process exited with code {proc.exitcode}")

        loop.add_reader(proc.sentinel, on_child_exit)
        front.set_tokenizer(tokenizer, token_bytes)
        quiet_collector()
        if await _first(stop, front.dead_event, front.ready_event) and front.ready is not None:
            # Both ends are connected: the socket files are not needed any more (and a
            # front killed later leaves nothing behind in /tmp).
            shutil.rmtree(ipc_dir, ignore_errors=True)
        await _first(stop, front.dead_event)
        if not stop.is_set() and front.ready is None:
            logger.error("the scheduler process failed to start: %s", front.dead)
            code = 1
        else:  # the scheduler may have died after Ready: keep answering 503 until told
            await stop.wait()
        logger.info("shutting down")
    finally:
        front.stop_serving("the server is shutting down")
        await runner.cleanup()
        await front.stop()
        if proc is not None:
            if proc.is_alive():
                loop.remove_reader(proc.sentinel)
            _stop_scheduler(to_scheduler, proc)
    return code


# Collector thresholds of the front while it serves (CPython's default: 700, 10, 10).
FRONT_GC_THRESHOLDS = (7000, 20, 100)


def quiet_collector() -> None:
    """Keep the garbage collector from stalling every stream, once everything is loaded.

    1. Freeze what exists now (transformers and the tokenizer: ~300k objects, alive as long
       as the process): a full collection no longer walks them (~0.1 s each before).
    2. Collect less often. What a stream allocates per token (messages, deltas, lists,
       event dicts) is acyclic and freed by reference counting; with the default
       thresholds the survivors of one step still set off full collections several times
       a second under load, each walking every stream's live state (15-28 ms at 256
       streams on a 2-core VM), and in steady state they found nothing to free
       (`benchmarks.bench_front`, gc.callbacks). Full collections still run, ~100x less
       often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*FRONT_GC_THRESHOLDS)


def _load_tokenizer(model_path: str) -> tuple[Any, TokenBytes | None] | None:
    """The tokenizer and its byte table (None: detokenize by windows), or None after
    logging why it cannot be loaded (one line)."""
    try:
        tokenizer = load_tokenizer(model_path)
    except (OSError, ValueError) as e:
        logger.error("cannot load the tokenizer of %s: %s", model_path, e)
        return None
    token_bytes = TokenBytes.build(tokenizer)
    if token_bytes is None:
        logger.info("detokenizing by windows: the tokenizer's decoding is not per-token bytes")
    return tokenizer, token_bytes


async def _first(*waitables: asyncio.Event | asyncio.Future) -> bool:
    """Wait until one event is set or future done; True unless it was the first one
    (the stop event) that ended the wait."""
    tasks = [
        asyncio.ensure_future(w.wait() if isinstance(w, asyncio.Event) else w) for w in waitables
    ]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t, w in zip(tasks, waitables):
        if t in pending and isinstance(w, asyncio.Event):
            t.cancel()
    return tasks[0] not in done


def _stop_scheduler(
    to_scheduler: Channel[ToScheduler], proc: multiprocessing.process.BaseProcess
) -> None:
    if proc.is_alive():
        try:
            to_scheduler.send(Shutdown())
        except ConnectionError:
            logger.warning("scheduler process unreachable; terminating it")
        proc.join(SHUTDOWN_TIMEOUT_S)
    if proc.is_alive():
        proc.terminate()
        proc.join(SHUTDOWN_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
