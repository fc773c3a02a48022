"""A fake scheduler process for the front-capacity benchmark (benchmarks.bench_front).

It speaks the real protocol (radixrt.server.messages over radixrt.server.channel): `Ready`
once, then per step one `TokenBatchOut` with one `RequestDelta` per running row and a
`SchedulerSnapshot`. It runs no model: at a fixed step interval every running request gets
its next token, a real text token of the tokenizer (`stream_tokens`: the shipped corpus,
multi-byte characters included), until `max_tokens` ("length"). `AbortRequest` ends a row
at once (the reason it names), as the real scheduler does.

A control socket (REQ/REP, msgpack dicts) sets the step interval and the number of requests
to wait for before the first step (so that N streams start together), and reads the step
statistics: {"op": "configure", "interval_s", "streams"} and {"op": "stats"}.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from benchmarks.front_boot import boot
from radixrt.deltas import FinishReason, RequestDelta
from radixrt.server.channel import Channel, MsgpackCodec
from radixrt.server.messages import (
    AbortRequest,
    FromScheduler,
    Ready,
    SchedulerSnapshot,
    Shutdown,
    TokenBatchOut,
    TokenizedRequest,
    ToScheduler,
)
from radixrt.stats import EngineStats

STREAM_STRIDE = 7919  # stream i starts at start position (i * STREAM_STRIDE) % len(starts)
BARRIER_TIMEOUT_S = 10.0  # idle: start stepping this long after the first request at most
IDLE_POLL_MS = 200  # idle wait between checks that the parent lives
NUM_KV_BLOCKS = 1 << 20  # what Ready reports (nothing is allocated)
CORPUS_FILE = "corpus.txt"  # of radixrt/model/data (ASCII and multi-byte text)


@dataclass(frozen=True)
class TokenSource:
    """The token ids streams cycle through, where a stream may start, and the ids its
    prompt is made of (a stream's prompt is its key: the fake scheduler derives its
    tokens from it)."""

    ids: list[int]  # the corpus, encoded
    starts: list[int]  # positions in ids whose token is whole ASCII text (a clean start)
    keys: list[int]  # ids that decode alone to ASCII letters (prompt tokens)

    def prompt_ids(self, stream: int) -> list[int]:
        """The prompt stream `stream` sends: two key tokens."""
        k = len(self.keys)
        assert 0 <= stream < k * k, f"stream {stream} has no key (at most {k * k} streams)"
        return [self.keys[stream % k], self.keys[stream // k]]

    def stream_tokens(self, prompt: Sequence[int], n: int) -> list[int]:
        """The `n` tokens the fake scheduler emits for a request with this prompt."""
        k = len(self.keys)
        stream = self._key_index[prompt[0]] + k * self._key_index[prompt[1]]
        begin = self.starts[(stream * STREAM_STRIDE) % len(self.starts)]
        return [self.ids[(begin + j) % len(self.ids)] for j in range(n)]

    @functools.cached_property
    def _key_index(self) -> dict[int, int]:
        return {tok: i for i, tok in enumerate(self.keys)}


def token_source(tokenizer: Any) -> TokenSource:
    """The shipped corpus encoded with `tokenizer` (a HF fast tokenizer)."""
    from radixrt.model.tiny_data import DATA_DIR

    with open(os.path.join(DATA_DIR, CORPUS_FILE), encoding="utf-8") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    special = set(tokenizer.all_special_ids)
    pieces = {tok: tokenizer.decode([tok]) for tok in set(ids)}
    starts = [p for p, tok in enumerate(ids) if pieces[tok].isascii() and pieces[tok].strip()]
    keys = []
    for tok in range(len(tokenizer)):
        piece = tokenizer.decode([tok])
        if tok not in special and piece.isascii() and piece.isalpha():
            keys.append(tok)
    return TokenSource(ids, starts, keys)


@dataclass(frozen=True)
class FakeSchedulerArgs:
    source: TokenSource
    vocab_size: int
    control_addr: str  # ipc:// address this process binds its REP control socket at
    cpus: tuple[int, ...] | None = None  # sched_setaffinity (None: inherit the front's)
    code_dir: str | None = None  # the checkout whose radixrt it runs (None: this one's)
    in_addr: str = ""  # front -> scheduler (set by start_fake_scheduler)
    out_addr: str = ""  # scheduler -> front
    parent_pid: int = 0


def start_fake_scheduler(
    args: FakeSchedulerArgs, cfg: object, eos: list[int], to_scheduler: Channel, from_scheduler
) -> multiprocessing.process.BaseProcess:
    """A `radixrt.server.launch.SchedulerStarter` (bind `args` with functools.partial)."""
    full = dataclasses.replace(
        args, in_addr=to_scheduler.addr, out_addr=from_scheduler.addr, parent_pid=os.getpid()
    )
    target = "benchmarks.front_fake_scheduler:fake_scheduler_main"
    proc = multiprocessing.get_context("spawn").Process(
        target=boot,
        args=(args.code_dir, target, pickle.dumps((full,))),
        name="fake-scheduler",
        daemon=True,
    )
    proc.start()
    return proc


@dataclass
class _Row:
    rid: str
    tokens: list[int]  # everything it will emit
    prompt_tokens: int
    emitted: int = 0


def fake_scheduler_main(args: FakeSchedulerArgs) -> None:
    if args.cpus is not None:
        os.sched_setaffinity(0, args.cpus)
    ctx = zmq.Context()
    inbox: Channel[ToScheduler] = Channel(
        ctx, args.in_addr, MsgpackCodec(ToScheduler), push=False, bind=False
    )
    outbox: Channel[FromScheduler] = Channel(
        ctx, args.out_addr, MsgpackCodec(FromScheduler), push=True, bind=False
    )
    control = ctx.socket(zmq.REP)
    control.setsockopt(zmq.LINGER, 0)
    control.bind(args.control_addr)
    try:
        FakeScheduler(args, inbox, outbox, control).run()
    finally:
        inbox.close()
        outbox.close()
        control.close()
        ctx.term()


class FakeScheduler:
    def __init__(self, args: FakeSchedulerArgs, inbox: Channel, outbox: Channel, control) -> None:
        self.args = args
        self.inbox = inbox
        self.outbox = outbox
        self.control = control
        self.interval_s = 0.01
        self.expect = 1  # requests to wait for before the first step when idle
        self.waiting: list[_Row] = []
        self.running: list[_Row] = []
        self.first_waiting_at = 0.0
        self.stepping = False  # steps run (from the barrier until no row is left)
        self.next_step = 0.0  # perf_counter deadline of the next step, while stepping
        self._reset_stats()

    def _reset_stats(self) -> None:
        self.step_times: list[float] = []  # perf_counter at each emitting step
        self.tokens_emitted = 0
        self.late_steps = 0  # steps that started over one interval after their deadline
        self.requests_done = 0
        self.cpu_start = time.process_time()

    def run(self) -> None:
        self.outbox.send(
            Ready(os.getpid(), 1 << 20, self.args.vocab_size, NUM_KV_BLOCKS, 16, 1 << 16)
        )
        poller = zmq.Poller()
        poller.register(self.inbox.sock, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        while os.getppid() == self.args.parent_pid:
            timeout = IDLE_POLL_MS
            if self.stepping:
                timeout = max(0.0, (self.next_step - time.perf_counter()) * 1000)
            elif self.waiting:
                timeout = 5  # check the barrier's timeout
            events = dict(poller.poll(timeout))
            if self.control in events:
                self._on_control(msgspec.msgpack.decode(self.control.recv()))
            outputs: list[RequestDelta] = []
            if self.inbox.sock in events:
                msgs = self.inbox.drain()
                if any(isinstance(m, Shutdown) for m in msgs):
                    return
                outputs = self._handle(msgs)
            now = time.perf_counter()
            if not self.stepping and self.waiting:
                waited = now - self.first_waiting_at
                if len(self.waiting) >= self.expect or waited > BARRIER_TIMEOUT_S:
                    self.stepping, self.next_step = True, now
            if self.stepping and now >= self.next_step:
                outputs += self._step(now)
                self.stepping = bool(self.running or self.waiting)
            if outputs:
                self.outbox.send(TokenBatchOut(outputs, [], self._snapshot()))

    def _on_control(self, msg: dict) -> None:
        if msg["op"] == "configure":
            self.interval_s = float(msg["interval_s"])
            self.expect = int(msg["streams"])
            self._reset_stats()
            reply = {"ok": True}
        else:
            assert msg["op"] == "stats", msg
            reply = {
                "pid": os.getpid(),
                "step_times": self.step_times,
                "tokens_emitted": self.tokens_emitted,
                "late_steps": self.late_steps,
                "requests_done": self.requests_done,
                "rows_left": len(self.running) + len(self.waiting),
                "cpu_s": time.process_time() - self.cpu_start,
            }
        self.control.send(msgspec.msgpack.encode(reply))

    def _handle(self, msgs: list[ToScheduler]) -> list[RequestDelta]:
        """New requests wait for the next step; aborts end their row now."""
        finished = []
        for msg in msgs:
            if isinstance(msg, TokenizedRequest):
                n = msg.params.max_tokens
                tokens = self.args.source.stream_tokens(msg.prompt_ids, n)
                if not self.waiting:
                    self.first_waiting_at = time.perf_counter()
                self.waiting.append(_Row(msg.rid, tokens, len(msg.prompt_ids)))
            elif isinstance(msg, AbortRequest):
                for rows in (self.running, self.waiting):
                    for row in [r for r in rows if r.rid == msg.rid]:
                        rows.remove(row)
                        finished.append(_out(row, [], msg.reason))
                        self.requests_done += 1
        return finished

    def _step(self, now: float) -> list[RequestDelta]:
        """One token for every running row (waiting rows join first)."""
        self.running += self.waiting
        self.waiting = []
        self.step_times.append(now)
        outputs = []
        still = []
        for row in self.running:
            tok = row.tokens[row.emitted]
            row.emitted += 1
            done = row.emitted == len(row.tokens)
            outputs.append(_out(row, [tok], "length" if done else None))
            if done:
                self.requests_done += 1
            else:
                still.append(row)
        self.tokens_emitted += len(outputs)
        self.running = still
        # the next deadline; after a step over one interval late the schedule restarts
        # from now (no burst of catch-up steps)
        self.next_step += self.interval_s
        if self.next_step <= now:  # this step was over one interval late
            self.late_steps += 1
            self.next_step = now + self.interval_s
        return outputs

    def _snapshot(self) -> SchedulerSnapshot:
        return SchedulerSnapshot(
            EngineStats(
                running=len(self.running),
                waiting=len(self.waiting),
                kv_blocks_total=NUM_KV_BLOCKS,
                kv_blocks_free=NUM_KV_BLOCKS,
                generated_tokens=self.tokens_emitted,
                steps=len(self.step_times),
            )
        )


def _out(row: _Row, new_ids: list[int], finish_reason: str | None) -> RequestDelta:
    reason = None if finish_reason is None else FinishReason(finish_reason)
    return RequestDelta(row.rid, new_ids, reason, row.prompt_tokens, 0, 0)
