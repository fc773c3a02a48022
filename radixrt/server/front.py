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
from radixrt.server.protocol import ApiError, GenerationSpec
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
    ) -> None:
        self.tokenizer = tokenizer
        self.to_scheduler = to_scheduler
        self.from_scheduler = from_scheduler
        self.metrics = metrics
        self.ready: Ready | None = None  # set when the scheduler's Ready arrives
        self.dead: str | None = None  # why the scheduler is gone, once it is
        self.dead_event = asyncio.Event()
        self.snapshot: SchedulerSnapshot | None = None  # the scheduler's latest state
        self.states: dict[str, RequestState] = {}  # in-flight requests by rid
        self._ids = itertools.count()
        self._reader: asyncio.Task | None = None

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
        self.metrics.ready.set(0)
        self.dead_event.set()
        for st in list(self.states.values()):
            self._fail(st, self.unavailable_error())

    def unavailable_error(self) -> ApiError:
        if self.dead is not None:
            msg = f"the server cannot generate: {self.dead}"
            return ApiError(msg, status=503, type="server_error")
        return ApiError(
            "the model is still loading; retry shortly", status=503, type="server_error"
        )

    @property
    def serving(self) -> bool:
        return self.ready is not None and self.dead is None

    # ---- requests in ----
    def render_chat(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except (TemplateError, ValueError) as e:  # ValueError: the model has no template
            raise ApiError(f"the chat template rejected the messages: {e}", "messages") from e

    def generate(self, spec: GenerationSpec, group: str | None = None) -> Generation:
        """Validate, tokenize and send every request of `spec` (n per prompt). Raises
        ApiError (nothing is sent then): 503 while not serving, 400 for bad input."""
        if not self.serving:
            raise self.unavailable_error()
        if group is not None and any(st.group == group for st in self.states.values()):
            raise ApiError(f"request id {group!r} is already in use", param="rid")
        prepared = [self._prepare(spec, p, i) for i, p in enumerate(spec.prompts)]
        events: asyncio.Queue = asyncio.Queue()
        states = []
        for i, (ids, max_tokens) in enumerate(prepared):
            for j in range(spec.n):
                if group is None:
                    rid = f"{uuid.uuid4().hex[:16]}-{next(self._ids)}"
                elif len(prepared) * spec.n == 1:
                    rid = group
                else:
                    rid = f"{group}-{i * spec.n + j}"
                params = spec.params(max_tokens, choice=j)
                detok = IncrementalDetokenizer(
                    self.tokenizer, params.stop, params.skip_special_tokens, ids
                )
                states.append(RequestState(rid, i * spec.n + j, ids, params, detok, events, group))
        for st in states:
            self.states[st.rid] = st
        for st in states:  # a failed send fails every registered request (503)
            if not self._send(TokenizedRequest(st.rid, st.prompt_ids, st.params)):
                break
        return Generation(states, events, self.abort)

    def _prepare(
        self, spec: GenerationSpec, prompt: str | list[int], index: int
    ) -> tuple[list[int], int]:
        """Token ids and max_tokens of one prompt, checked against the model's limits."""
        assert self.ready is not None
        where = spec.prompt_param if len(spec.prompts) == 1 else f"{spec.prompt_param}[{index}]"
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=spec.add_special_tokens)
        else:
            ids = list(prompt)
        if not ids:
            raise ApiError(f"{where} is empty: at least one token is needed", spec.prompt_param)
        vocab = self.ready.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(
                f"token id {bad[0]} in {where} is outside the vocabulary [0, {vocab})",
                spec.prompt_param,
            )
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
        """Send to the scheduler; False (and stop serving) when it is unreachable."""
        try:
            self.to_scheduler.send(msg)
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

    def abort_group(self, group: str) -> int:
        """/abort: end the requests with this client rid (they finish with "abort")."""
        rids = [st.rid for st in self.states.values() if st.group == group or st.rid == group]
        for rid in rids:
            self._send(AbortRequest(rid))
        return len(rids)

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
                    self._fail(st, ApiError(err.message, param=None))
            self.snapshot = msg.snapshot
            self.metrics.update(msg.snapshot)
        elif isinstance(msg, Ready):
            self.ready = msg
            self.metrics.ready.set(1)
            self.metrics.kv_blocks_total.set(msg.kv_blocks_total)
            logger.info(
                "scheduler ready (pid %d): max_model_len=%d, vocab=%d, %d KV blocks",
                msg.pid, msg.max_model_len, msg.vocab_size, msg.kv_blocks_total,
            )  # fmt: skip
        elif isinstance(msg, SchedulerFailed):
            last = msg.message.strip().splitlines()[-1]
            self.stop_serving(f"the scheduler process failed ({last})")

    def _on_output(self, st: RequestState, out: TokenOut) -> None:
        st.num_cached_tokens = out.num_cached_tokens
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
            st.events.put_nowait((st, Delta(text, list(new_ids), new_lps, reason)))
        if final:
            self._finish(st, reason)

    def _finish(self, st: RequestState, reason: str) -> None:
        st.finish_reason = reason
        self.states.pop(st.rid, None)
        self.metrics.finished(
            reason, st.prompt_tokens, st.num_cached_tokens, time.perf_counter() - st.created
        )

    def _fail(self, st: RequestState, error: ApiError) -> None:
        st.error = error
        self.states.pop(st.rid, None)
        self.metrics.requests.labels(finish_reason="error").inc()
        st.events.put_nowait((st, error))
