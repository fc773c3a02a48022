"""The scheduler process: EngineCore driven by messages from the front process.

Loop: drain incoming messages (block on the socket only when there is no work), one
engine step, then ONE `TokenBatchOut` with every changed request's new token ids,
finish info and cached-token count (an empty one at least every `HEARTBEAT_S` while steps
run: the front's proof of progress). Exits on `Shutdown`, on SIGTERM, or when its
parent (the front) is gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq

from radixrt.deltas import FinishReason, RequestDelta
from radixrt.errors import RequestValueError
from radixrt.server.channel import Channel, MsgpackCodec
from radixrt.server.kv_publisher import KVEventsConfig, ZmqEventPublisher
from radixrt.server.liveness import HEARTBEAT_S
from radixrt.server.messages import (
    AbortRequest,
    BeamSearchRequest,
    CacheFlushed,
    CacheHoldsReleased,
    CachePressureRead,
    FlushCache,
    FromScheduler,
    ReadCachePressure,
    Ready,
    ReleaseCacheHolds,
    RequestError,
    SchedulerFailed,
    SchedulerSnapshot,
    Shutdown,
    TokenBatchOut,
    TokenizedRequest,
    ToScheduler,
)

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5  # idle wait on the socket between checks that the parent lives
IDLE_SNAPSHOT_S = 2.0  # the stats the front serves (/health, /metrics) are this fresh when idle


@dataclass(frozen=True)
class SchedulerProcessArgs:
    model_path: str
    device: str
    dtype: str
    eos_token_ids: list[int]
    in_addr: str  # front -> scheduler (this end pulls, connects)
    out_addr: str  # scheduler -> front (this end pushes, connects)
    parent_pid: int  # exit when this process is no longer our parent
    options: dict[str, object] = field(default_factory=dict)  # resolve_config options
    debug: bool = False  # run check_integrity() whenever the engine goes idle
    cpu_threads: int | None = None  # torch threads on CPU; None: all cores but one (the front's)
    log_level: str = "INFO"
    kv_events: KVEventsConfig | None = None  # publish KV events there; None: off


def scheduler_main(args: SchedulerProcessArgs) -> None:
    """Entry point of the spawned process."""
    # Ctrl-C reaches the whole process group; the front decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s scheduler %(levelname)s %(message)s"
    )
    ctx = zmq.Context()
    inbox: Channel[ToScheduler] = Channel(
        ctx, args.in_addr, MsgpackCodec(ToScheduler), push=False, bind=False
    )
    outbox: Channel[FromScheduler] = Channel(
        ctx, args.out_addr, MsgpackCodec(FromScheduler), push=True, bind=False
    )
    code = 0
    core = None
    publisher = None
    try:
        core = build_core(args)
        if args.kv_events is not None:
            publisher = ZmqEventPublisher(args.kv_events, ctx)
        SchedulerLoop(core, inbox, outbox, args.parent_pid, args.debug, publisher).run()
    except SystemExit:
        logger.info("terminated by SIGTERM")
    except Exception:
        message = traceback.format_exc()
        logger.error("scheduler loop failed:\n%s", message)
        outbox.send(SchedulerFailed(message))
        code = 1
    finally:
        if core is not None:
            core.shutdown()  # tensor-parallel workers
        if publisher is not None:
            publisher.shutdown()
        inbox.close()
        outbox.close()
        ctx.term()
        if os.getppid() != args.parent_pid:  # the front died without cleaning up
            _remove_ipc_dir(args.in_addr)
    # Sockets are closed and the engine holds no outside resource: leave without the
    # interpreter's slow finalization of torch (the front joins this process).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _remove_ipc_dir(addr: str) -> None:
    """Remove the directory of an ipc:// socket address (and what is in it)."""
    if addr.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(addr.removeprefix("ipc://")), ignore_errors=True)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)  # unwinds to scheduler_main's cleanup


def build_core(args: SchedulerProcessArgs):
    """Load the model and build the EngineCore, as `Engine` does."""
    from radixrt.config import ModelConfig, resolve_config
    from radixrt.engine.core import EngineCore
    from radixrt.hf_dir import check_model_dir

    check_model_dir(args.model_path, require_weights=args.options.get("load_format") != "dummy")
    # The front needs a core too; oversubscribed OpenMP threads spin and stall a step.
    threads = args.cpu_threads or max(1, len(os.sched_getaffinity(0)) - 1)
    # a process of its own: freezing the startup objects stalls nothing else
    options = {"cpu_threads": threads, "freeze_gc": True, **args.options}
    cfg = resolve_config(args.model_path, args.device, args.dtype, **options)
    model_config = ModelConfig.from_pretrained(args.model_path)
    core = EngineCore(cfg, model_config, args.eos_token_ids)
    if core.grammar_backend is not None:  # warm before the first constrained request
        core.grammar_backend.start()
    return core


class SchedulerLoop:
    def __init__(
        self,
        core,
        inbox: Channel[ToScheduler],
        outbox: Channel[FromScheduler],
        parent_pid: int,
        debug: bool = False,
        kv_publisher: ZmqEventPublisher | None = None,
    ) -> None:
        self.core = core
        self.kv_publisher = kv_publisher  # gets the KV events of each step
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.debug = debug

    def run(self) -> None:
        core = self.core
        self.outbox.send(
            Ready(
                pid=os.getpid(),
                max_model_len=core.max_model_len,
                vocab_size=core.model_config.vocab_size,
                kv_blocks_total=core.allocator.num_blocks,
                block_size=core.config.cache.block_size,
                max_running_requests=core.config.scheduler.max_running_requests,
                num_eos_ids=len(core.scheduler.eos_token_ids),
                policy=core.config.scheduler.policy,
                prefix_cache=core.config.cache.prefix_cache,
            )
        )
        logger.info("ready: max_model_len=%d", core.max_model_len)
        last_sent = time.monotonic()
        while self._parent_alive():
            msgs = self._receive()
            if any(isinstance(m, Shutdown) for m in msgs):
                logger.info("shutdown requested")
                return
            errors, finished = self._handle(msgs)
            stepped = core.has_work
            changed = core.step() if stepped else []
            if self.kv_publisher is not None:
                events = core.take_kv_events()  # this step's, and those of aborts before it
                if events:
                    self.kv_publisher.publish(events)
            now = time.monotonic()
            # a heartbeat (an empty batch) when steps go by without output: the front
            # takes any message as progress (radixrt.server.liveness); idle, one now and
            # then carries fresh stats, so /health sees a fault (a dead grammar compiler)
            # that no request has met yet
            if msgs or changed or now - last_sent >= (HEARTBEAT_S if stepped else IDLE_SNAPSHOT_S):
                last_sent = now
                outputs = []
                for d in (*finished, *changed):
                    if d.finish_reason is FinishReason.ERROR:  # failed on our side: a 500
                        message = d.error or "internal error"
                        # a bad grammar: 400; the grammar compiler down: 503
                        status = 400 if d.invalid_request else 503 if d.unavailable else 500
                        errors.append(
                            RequestError(
                                d.rid,
                                message,
                                status,
                                d.parent_rid,
                                d.index,
                                d.error_param,
                                grammar=d.invalid_request,
                            )
                        )
                    else:
                        outputs.append(d)
                snapshot = self._snapshot()
                self.outbox.send(TokenBatchOut(outputs, errors, snapshot))
        logger.info("parent process %d is gone; exiting", self.parent_pid)

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def _receive(self) -> list[ToScheduler]:
        if self.core.has_work:
            return self.inbox.drain()
        first = self.inbox.recv(timeout_s=PARENT_POLL_S)
        if first is None:
            self.core.check_health()  # idle: a dead tensor-parallel rank fails us now
            return []
        return [first, *self.inbox.drain()]

    def _handle(self, msgs: Sequence[ToScheduler]) -> tuple[list[RequestError], list[RequestDelta]]:
        errors: list[RequestError] = []
        finished: list[RequestDelta] = []
        for msg in msgs:
            if isinstance(msg, (TokenizedRequest, BeamSearchRequest)):
                try:
                    if isinstance(msg, TokenizedRequest):
                        self.core.add_request(
                            msg.prompt_ids, msg.params, msg.rid, msg.tenant, msg.options
                        )
                    else:
                        self.core.add_beam_search(
                            msg.prompt_ids, msg.params, msg.rid, msg.tenant, msg.options
                        )
                except ValueError as e:  # bad input: a RequestValueError names the field
                    field = e.field if isinstance(e, RequestValueError) else None
                    errors.append(RequestError(msg.rid, str(e), 400, param=field))
                except Exception as e:  # a bug: this request fails, the loop goes on
                    logger.exception("adding request %s failed", msg.rid)
                    errors.append(RequestError(msg.rid, f"internal error: {e}", 500))
            elif isinstance(msg, AbortRequest):
                from radixrt.scheduler.request import fork_rid

                rid = msg.rid if msg.index is None else fork_rid(msg.rid, msg.index)
                delta = self.core.abort(rid, FinishReason(msg.reason))
                if delta is not None:
                    finished.append(delta)
            elif isinstance(msg, FlushCache):
                self.outbox.send(self._flush(msg))
            elif isinstance(msg, ReleaseCacheHolds):
                released = sum(self.core.release_cache_hold(rid) for rid in msg.rids)
                self.outbox.send(CacheHoldsReleased(msg.call_id, released))
            elif isinstance(msg, ReadCachePressure):
                covers = None if msg.scope is None else msg.scope.covers
                pressure = self.core.cache_pressure(covers, msg.tenant)
                self.outbox.send(CachePressureRead(msg.call_id, pressure))
        return errors, finished

    def _flush(self, msg: FlushCache) -> CacheFlushed:
        free = self.core.allocator.num_free
        try:
            freed = self.core.flush_cache(None if msg.scope is None else msg.scope.covers)
        except AssertionError:
            error = traceback.format_exc()
            logger.error("integrity check failed after a cache flush:\n%s", error)
            return CacheFlushed(msg.flush_id, self.core.allocator.num_free - free, error)
        logger.info("prefix cache flushed: %d blocks freed", freed)
        return CacheFlushed(msg.flush_id, freed)

    def _snapshot(self) -> SchedulerSnapshot:
        core = self.core
        integrity_error = None
        if self.debug and not core.has_work:
            try:
                core.check_integrity()
            except AssertionError:
                integrity_error = traceback.format_exc()
                logger.error("integrity check failed:\n%s", integrity_error)
        return SchedulerSnapshot(core.stats_struct(), integrity_error)
