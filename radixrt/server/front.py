"""The front process's engine side: tokenizer, per-request state, incremental
detokenization and stop strings, talking to the scheduler process over two channels.

Runs on the asyncio loop of the HTTP server. `Front.generate(spec)` validates and
tokenizes a request, sends it, and returns a `Generation` whose events the HTTP handler
consumes; leaving its `async with` block aborts whatever is unfinished (client gone).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
from jinja2.exceptions import TemplateError

from radixrt.detokenizer import IncrementalDetokenizer
from radixrt.server.channel import Channel
from radixrt.server.messages import (
    AbortRequest,
    FromScheduler,
    Ready,
    SchedulerFailed,
    SchedulerSnapshot,
    TokenBatchOut,
    TokenizedRequest,
    TokenOut,
    ToScheduler,
)
from radixrt.server.metrics import ServerMetrics
from radixrt.server.protocol import ApiError, GenerationSpec, ModelInfo
from radixrt.server.request_state import Delta, Generation, RequestState

logger = logging.getLogger(__name__)


def eos_token_ids(model_config: Any, tokenizer: Any) -> list[int]:
    """EOS ids of the checkpoint config plus the tokenizer's (as `Engine` does)."""
    eos = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return sorted(eos)


class Front:
    def __init__(
        self,
        tokenizer: Any,
        to_scheduler: Channel[ToScheduler],
        from_scheduler: Channel[FromScheduler],
        metrics: ServerMetrics,
        model_name: str = "default",
    ) -> None:
        self.tokenizer = tokenizer  # None until loaded (the server answers 503 until then)
        self.to_scheduler = to_scheduler
        self.from_scheduler = from_scheduler
        self.metrics = metrics
        self.model_name = model_name  # the id /v1/models lists
        self.ready: Ready | None = None  # set when the scheduler's Ready arrives
        self.dead: str | None = None  # why the scheduler is gone, once it is
        self.dead_event = asyncio.Event()
        self.ready_event = asyncio.Event()  # set when serving starts
        self.snapshot: SchedulerSnapshot | None = None  # the scheduler's latest state
        self.states: dict[str, RequestState] = {}  # in-flight requests by (internal) rid
        self.by_client_rid: dict[str, list[RequestState]] = {}  # in flight, by client rid
        # internal rids: a counter plus this process's random tag (never a client's id)
        self._ids = itertools.count()
        self._tag = uuid.uuid4().hex[:8]
        self._reader: asyncio.Task | None = None
        metrics.in_flight.set_function(lambda: len(self.states))

    # ---- lifecycle ----
    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    def stop_serving(self, reason: str) -> None:
        """Fail every in-flight request and refuse new ones (503) from now on (the
        scheduler is gone, or the server is shutting down)."""
        if self.dead is not None:
            return
        self.dead = reason
        logger.warning("not serving any more: %s", reason)
        self.metrics.scheduler_gone()
        self.dead_event.set()
        for st in list(self.states.values()):
            self._fail(st, self.unavailable_error())

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._check_ready()

    def unavailable_error(self) -> ApiError:
        if self.dead is not None:
            msg = f"the server cannot generate: {self.dead}"
            return ApiError(msg, status=503, type="server_error")
        return ApiError(
            "the model is still loading; retry shortly", status=503, type="server_error"
        )

    @property
    def serving(self) -> bool:
        return self.ready is not None and self.tokenizer is not None and self.dead is None

    def model_info(self) -> ModelInfo:
        """The served model's limits; raises the 503 ApiError while not serving."""
        if not self.serving:
            raise self.unavailable_error()
        assert self.ready is not None
        return ModelInfo(self.model_name, self.ready.vocab_size, self.ready.max_model_len)

    # ---- requests in ----
    def render_chat(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except (TemplateError, ValueError) as e:  # ValueError: the model has no template
            raise ApiError(f"the chat template rejected the messages: {e}", "messages") from e

    def generate(self, spec: GenerationSpec, client_rid: str | None = None) -> Generation:
        """Tokenize and send every request of `spec` (n per prompt). Raises ApiError
        (nothing is sent and no state is kept then): 503 while not serving, 400 for a
        prompt that does not fit or a client rid already in flight."""
        if not self.serving:
            raise self.unavailable_error()
        if client_rid is not None and client_rid in self.by_client_rid:
            raise ApiError(f"request id {client_rid!r} is already in use", param="rid")
        prepared = [self._prepare(spec, p, i) for i, p in enumerate(spec.prompts)]
        events: asyncio.Queue = asyncio.Queue()
        states = []
        for i, (ids, max_tokens) in enumerate(prepared):
            for j in range(spec.n):
                params = spec.params(max_tokens, choice=j)
                detok = IncrementalDetokenizer(
                    self.tokenizer, params.stop, params.skip_special_tokens, ids
                )
                rid = f"{next(self._ids)}-{self._tag}"
                index = i * spec.n + j
                states.append(RequestState(rid, index, ids, params, detok, events, client_rid))
        try:  # encode all first: a failure leaves nothing behind
            encoded = [
                self.to_scheduler.codec.encode(TokenizedRequest(st.rid, st.prompt_ids, st.params))
                for st in states
            ]
        except (msgspec.EncodeError, OverflowError, TypeError) as e:
            logger.exception("could not encode a validated request")
            raise ApiError(f"internal error: {e}", status=500, type="server_error") from e
        for st in states:
            self.states[st.rid] = st
        if client_rid is not None:
            self.by_client_rid[client_rid] = list(states)
        for data in encoded:  # a failed send fails every registered request (503)
            if not self._send_encoded(data):
                break
        return Generation(states, events, self.abort)

    def _prepare(
        self, spec: GenerationSpec, prompt: str | list[int], index: int
    ) -> tuple[list[int], int]:
        """Token ids and max_tokens of one prompt, checked against the context length
        (vLLM's rule): the prompt must leave room for one token; an explicit max_tokens
        must fit after it; an absent one is the room left (at most the default)."""
        assert self.ready is not None
        where = spec.prompt_param if len(spec.prompts) == 1 else f"{spec.prompt_param}[{index}]"
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=spec.add_special_tokens)
        else:
            ids = list(prompt)  # token ids: checked against the vocabulary by protocol
        if not ids:
            raise ApiError(f"{where} is empty: at least one token is needed", spec.prompt_param)
        limit, n = self.ready.max_model_len, len(ids)
        if n >= limit:
            raise ApiError(
                f"{where} has {n} tokens; this model's context length is {limit} tokens, "
                f"so a prompt may have at most {limit - 1}",
                spec.prompt_param,
            )
        if spec.max_tokens is None:
            room = limit - n
            max_tokens = (
                room if spec.default_max_tokens is None else min(room, spec.default_max_tokens)
            )
        else:
            max_tokens = spec.max_tokens
            if n + max_tokens > limit:
                raise ApiError(
                    f"this model's context length is {limit} tokens, but {n + max_tokens} were "
                    f"requested ({n} in {where} + {max_tokens} {spec.max_tokens_param}); "
                    f"reduce {spec.max_tokens_param} to at most {limit - n} or shorten the prompt",
                    spec.max_tokens_param,
                )
        return ids, max_tokens

    def _send(self, msg: ToScheduler) -> bool:
        return self._send_encoded(self.to_scheduler.codec.encode(msg))

    def _send_encoded(self, data: bytes) -> bool:
        """Send to the scheduler; False (and stop serving) when it is unreachable."""
        try:
            self.to_scheduler.send_encoded(data)
        except ConnectionError as e:
            self.stop_serving(f"the scheduler process is gone ({e})")
            return False
        return True

    def abort(self, st: RequestState) -> None:
        """Client gone: stop the request now; the scheduler frees its KV."""
        if st.finished:
            return
        self._finish(st, "abort")
        self._send(AbortRequest(st.rid))

    def abort_client_rid(self, rid: str) -> int:
        """/abort: end the unfinished requests with this client rid, or the one request
        without a client rid whose own id (the `id` /generate returned) this is; they
        finish with "abort" when the scheduler confirms. Returns how many."""
        states = self.by_client_rid.get(rid)
        if states is None:
            st = self.states.get(rid)
            states = [st] if st is not None and st.client_rid is None else []
        pending = [st for st in states if not st.finished]
        for st in pending:
            self._send(AbortRequest(st.rid))
        return len(pending)

    # ---- outputs in ----
    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self.from_scheduler.recv_async()
                self._dispatch(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("front failed to handle a scheduler message")
            self.stop_serving(f"the front failed to read scheduler output ({e!r})")

    def _dispatch(self, msg: FromScheduler) -> None:
        if isinstance(msg, TokenBatchOut):
            for out in msg.outputs:
                st = self.states.get(out.rid)
                if st is not None:
                    self._on_output(st, out)
            for err in msg.errors:
                st = self.states.get(err.rid)
                if st is not None:
                    kind = "server_error" if err.status >= 500 else "invalid_request_error"
                    self._fail(st, ApiError(err.message, status=err.status, type=kind))
            self.snapshot = msg.snapshot
            self.metrics.update(msg.snapshot)
        elif isinstance(msg, Ready):
            self.ready = msg
            # Nothing has run yet: every block is free. This is the state until the first
            # TokenBatchOut replaces it.
            self.snapshot = initial_snapshot(msg)
            self.metrics.update(self.snapshot)
            logger.info(
                "scheduler ready (pid %d): max_model_len=%d, vocab=%d, %d KV blocks",
                msg.pid, msg.max_model_len, msg.vocab_size, msg.kv_blocks_total,
            )  # fmt: skip
            self._check_ready()
        elif isinstance(msg, SchedulerFailed):
            last = msg.message.strip().splitlines()[-1]
            self.stop_serving(f"the scheduler process failed ({last})")

    def _check_ready(self) -> None:
        if self.serving:
            self.metrics.ready.set(1)
            self.ready_event.set()

    def _on_output(self, st: RequestState, out: TokenOut) -> None:
        st.num_cached_tokens = out.num_cached_tokens
        st.num_draft_tokens, st.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
        final = out.finish_reason is not None
        if final and st.params.prompt_logprobs:
            st.prompt_logprobs = list(out.prompt_logprobs)
        new_ids: Sequence[int] = [] if st.stop_seen else out.new_ids
        if new_ids:
            now = time.perf_counter()
            if st.last_token_at is None:
                self.metrics.ttft.observe(now - st.created)
            else:
                self.metrics.itl.observe(now - st.last_token_at)
            st.last_token_at = now
            self.metrics.generated_tokens.inc(len(new_ids))
        st.output_ids.extend(new_ids)
        new_lps = list(out.new_logprobs) if not st.stop_seen else []
        st.logprobs.extend(new_lps)
        new_top = [list(map(tuple, top)) for top in out.new_top_logprobs] if new_lps else []
        st.top_logprobs.extend(new_top)
        text = st.detok.add(new_ids, final=final)
        st.text += text
        if st.detok.stopped and not st.stop_seen:
            # A stop string: the text is complete. The scheduler ends the request with
            # reason "stop" and its final TokenOut (with prompt log-probs) finishes it here.
            st.stop_seen = True
            if not final:
                self._send(AbortRequest(st.rid, reason="stop"))
        reason = out.finish_reason
        if reason is not None and st.stop_seen:
            reason = "stop"
        if text or new_ids or final:
            st.events.put_nowait((st, Delta(text, list(new_ids), new_lps, reason, new_top)))
        if final:
            self._finish(st, reason)

    def _finish(self, st: RequestState, reason: str) -> None:
        st.finish_reason = reason
        self._forget(st)
        self.metrics.finished(
            reason, st.prompt_tokens, st.num_cached_tokens, time.perf_counter() - st.created
        )

    def _fail(self, st: RequestState, error: ApiError) -> None:
        st.error = error
        self._forget(st)
        self.metrics.requests.labels(finish_reason="error").inc()
        st.events.put_nowait((st, error))

    def _forget(self, st: RequestState) -> None:
        """Drop the front's state of a finished or failed request (every path ends here)."""
        self.states.pop(st.rid, None)
        if st.client_rid is not None:
            group = self.by_client_rid.get(st.client_rid)
            if group is not None and all(s.finished for s in group):
                del self.by_client_rid[st.client_rid]


def initial_snapshot(ready: Ready) -> SchedulerSnapshot:
    """The scheduler's state right after Ready: nothing running, every KV block free."""
    total = ready.kv_blocks_total
    return SchedulerSnapshot(
        running=0,
        waiting=0,
        kv_blocks_total=total,
        kv_blocks_free=total,
        kv_blocks_cached=0,
        kv_blocks_in_use=0,
        cache_hit_rate=0.0,
        prompt_tokens=0,
        cached_tokens=0,
        generated_tokens=0,
        preemptions=0,
        steps=0,
    )
