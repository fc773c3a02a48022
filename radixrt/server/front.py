"""The front process's engine side: tokenizer, per-request state, incremental
detokenization and stop strings, talking to the scheduler process over two channels.

Runs on the asyncio loop of the HTTP server. `Front.generate(spec)` validates and
tokenizes a request, sends it, and returns a `Generation` whose events the HTTP handler
consumes; leaving its `async with` block aborts whatever is unfinished (client gone).
The front's reader hands the scheduler's token batches to its `FrontOutputs` (which owns
the in-flight states) and handles the rest itself: Ready, answers to its calls (cache
flush, hold release, cache pressure) and the scheduler's failure.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import msgspec
from jinja2.exceptions import TemplateError

from radixrt.detokenizer import IncrementalDetokenizer
from radixrt.errors import RequestValueError
from radixrt.limits import resolve_max_tokens
from radixrt.lora import LoraRegistry, UnknownLora
from radixrt.sampling import LoraRef, RequestOptions
from radixrt.server.channel import Channel
from radixrt.server.chat import ChatTemplateOptions
from radixrt.server.front_outputs import FrontOutputs
from radixrt.server.groups import beam_params, check_group_fits
from radixrt.server.holds import HeldRequests
from radixrt.server.liveness import Liveness, StallPolicy
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
    SaltScope,
    SchedulerFailed,
    TokenBatchOut,
    TokenizedRequest,
    ToScheduler,
)
from radixrt.server.metrics import ServerMetrics
from radixrt.server.protocol import ApiError, GenerationSpec, ModelInfo
from radixrt.server.request_state import Generation, Outbox, RequestState
from radixrt.server.tenants import Tenants
from radixrt.token_bytes import TokenBytes

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Front:
    """Requests in (validate, tokenize, send), calls to the scheduler and the lifecycle;
    the in-flight requests and the handling of their outputs belong to `outputs`."""

    def __init__(
        self,
        tokenizer: Any,
        to_scheduler: Channel[ToScheduler],
        from_scheduler: Channel[FromScheduler],
        metrics: ServerMetrics,
        model_name: str = "default",
        stall_policy: StallPolicy | None = None,
        tenants: Tenants | None = None,
        loras: LoraRegistry | None = None,
    ) -> None:
        self.tokenizer = tokenizer  # None until loaded (the server answers 503 until then)
        self.token_bytes: TokenBytes | None = None  # the tokenizer's byte table, if any
        self.to_scheduler = to_scheduler
        self.from_scheduler = from_scheduler
        self.metrics = metrics
        self.model_name = model_name  # the id /v1/models lists
        self.tenants = tenants  # what each tenant's requests may claim (None: no tenants)
        self.loras = loras  # the LoRA adapters served (None: LoRA off)
        self.ready: Ready | None = None  # set when the scheduler's Ready arrives
        self.dead: str | None = None  # why the scheduler is gone, once it is
        self.dead_event = asyncio.Event()
        self.ready_event = asyncio.Event()  # set when serving starts
        self._ids = itertools.count()  # ids of calls to the scheduler
        self._reader: asyncio.Task | None = None
        self.liveness = Liveness(stall_policy or StallPolicy())
        self._watchdog: asyncio.Task | None = None
        # FlushCache, ReleaseCacheHolds, ReadCachePressure in flight, by their id
        self.calls: dict[int, asyncio.Future] = {}
        self.held = HeldRequests()  # finished requests that may hold their context
        self._scoped_reads: set[int] = set()  # one tenant's pressure reads: not every hold
        # tokenizing and chat templates: long texts take seconds, which the event loop
        # (every other request's streaming, /health) must not wait for
        self.work = ThreadPoolExecutor(1, thread_name_prefix="radixrt-tokenize")
        self.outputs = FrontOutputs(
            metrics, self._send, self._decode, self.liveness.on_finished, self.held.add
        )

    # ---- lifecycle ----
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_loop())
        self._watchdog = loop.create_task(self._watch_liveness())

    async def stop(self) -> None:
        tasks = [t for t in (self._reader, self._watchdog) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.work.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the front's worker thread (request work that may take long:
        chat templates, tokenizing); its exceptions propagate."""
        return await asyncio.get_running_loop().run_in_executor(self.work, fn, *args)

    def stop_serving(self, reason: str) -> None:
        """Fail every in-flight request and refuse new ones (503) from now on (the
        scheduler is gone, or the server is shutting down)."""
        if self.dead is not None:
            return
        self.dead = reason
        logger.warning("not serving any more: %s", reason)
        self.metrics.scheduler_gone()
        self.dead_event.set()
        self.outputs.fail_all(self.unavailable_error(), abort=False)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self.from_scheduler.recv_async()
                self._on_progress()
                self._dispatch(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("front failed to handle a scheduler message")
            self.stop_serving(f"the front failed to read scheduler output ({e!r})")

    def _dispatch(self, msg: FromScheduler) -> None:
        if isinstance(msg, TokenBatchOut):
            self.outputs.on_batch(msg)
        elif isinstance(msg, Ready):
            self.ready = msg
            self.outputs.on_ready(msg)
            logger.info(
                "scheduler ready (pid %d): max_model_len=%d, vocab=%d, %d KV blocks",
                msg.pid, msg.max_model_len, msg.vocab_size, msg.kv_blocks_total,
            )  # fmt: skip
            self._check_ready()
        elif isinstance(msg, (CacheFlushed, CacheHoldsReleased, CachePressureRead)):
            if isinstance(msg, CachePressureRead):
                if msg.call_id in self._scoped_reads:  # one tenant's holds: not every record's
                    self._scoped_reads.discard(msg.call_id)
                else:  # read after every request recorded so far had finished (held or not)
                    self.held.keep_only(msg.pressure.held)
            future = self.calls.get(msg.flush_id if isinstance(msg, CacheFlushed) else msg.call_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, SchedulerFailed):
            last = msg.message.strip().splitlines()[-1]
            self.stop_serving(f"the scheduler process failed ({last})")

    def _check_ready(self) -> None:
        if self.serving:
            self.metrics.ready.set(1)
            self.ready_event.set()

    async def _watch_liveness(self) -> None:
        """Every check interval (1 s at most): has the scheduler, with work in flight,
        gone silent past the stall timeout? Then fail what is in flight and refuse new
        requests until it sends again (`_on_progress`)."""
        liveness = self.liveness
        while True:
            await asyncio.sleep(liveness.policy.check_interval_s)
            if self.ready is None or self.dead is not None or liveness.stalled:
                continue
            silence = liveness.check(has_work=bool(self.outputs.states))
            if silence is not None:
                self._on_stall(silence)

    def _on_stall(self, silence: float) -> None:
        logger.error(
            "the scheduler process made no progress for %.1f s with %d requests in flight "
            "(limit %g s): failing them and refusing new requests until it does",
            silence, len(self.outputs.states), self.liveness.limit_s,
        )  # fmt: skip
        self.metrics.scheduler_stalls.inc()
        self.metrics.scheduler_stalled.set(1)
        self.metrics.ready.set(0)
        self.outputs.fail_all(self.unavailable_error(), abort=True)

    def _on_progress(self) -> None:
        """A message from the scheduler arrived: it makes progress."""
        ended = self.liveness.on_message()
        if ended is not None:
            logger.warning("the scheduler process made progress again after %.1f s", ended)
            self.metrics.scheduler_stalled.set(0)
            self._check_ready()

    def set_tokenizer(self, tokenizer: Any, token_bytes: TokenBytes | None = None) -> None:
        """Serve with `tokenizer`; `token_bytes` (`TokenBytes.build(tokenizer)`, built off
        the event loop: it decodes the vocabulary once) makes detokenization a table
        lookup per token, without it windows of tokens are decoded."""
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self._check_ready()

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def unavailable_error(self) -> ApiError:
        if self.dead is not None:
            msg = f"the server cannot generate: {self.dead}"
            return ApiError(msg, status=503, type="server_error")
        if self.liveness.stalled:
            return ApiError(self.stall_reason(), status=503, type="server_error")
        return ApiError(
            "the model is still loading; retry shortly", status=503, type="server_error"
        )

    def stall_reason(self) -> str:
        """Why a stalled scheduler is not serving (only while `liveness.stalled`)."""
        return (
            f"the scheduler process is stalled: no progress for "
            f"{self.liveness.stalled_for_s:.0f} s while it "
            f"had work (limit {self.liveness.limit_s:g} s); retry later"
        )

    @property
    def serving(self) -> bool:
        return (
            self.ready is not None
            and self.tokenizer is not None
            and self.dead is None
            and not self.liveness.stalled
        )

    def model_info(self) -> ModelInfo:
        """The served model's limits; raises the 503 ApiError while not serving."""
        if not self.serving:
            raise self.unavailable_error()
        assert self.ready is not None
        adapters = () if self.loras is None else tuple(self.loras.names())
        return ModelInfo(self.model_name, self.ready.vocab_size, self.ready.max_model_len, adapters)

    # ---- requests in ----
    def render_chat(
        self, messages: list[dict[str, str]], options: ChatTemplateOptions | None = None
    ) -> str:
        """The chat template applied to `messages` (ApiError when it refuses them)."""
        opts = options or ChatTemplateOptions()
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=opts.add_generation_prompt,
                continue_final_message=opts.continue_final_message,
                tools=opts.tools,
                **(opts.extra or {}),
            )
        # ValueError: no template; the lookups fail where a template indexes messages or
        # fields the request does not have (the request's fault, as a TemplateError is)
        except (TemplateError, ValueError, TypeError, LookupError, AttributeError) as e:
            raise ApiError(f"the chat template rejected the messages: {e!r}", "messages") from e

    def encode(self, spec: GenerationSpec) -> list[list[int]]:
        """Token ids of every prompt of `spec` (text is tokenized: run it `off_loop`)."""
        special = spec.add_special_tokens
        return [
            self.tokenizer.encode(p, add_special_tokens=special) if isinstance(p, str) else list(p)
            for p in spec.prompts
        ]

    def generate(
        self,
        spec: GenerationSpec,
        client_rid: str | None = None,
        tenant: str | None = None,
        prompt_ids: list[list[int]] | None = None,
    ) -> Generation:
        """Send one scheduler request per prompt of `spec` (n > 1: the scheduler forks n
        children; beam_width: a beam search), made under `tenant` (None: the server has no
        tenants). `prompt_ids`: the prompts' `encode`, done ahead off the event loop (None:
        tokenized here). Raises ApiError (nothing is sent and no state is kept then): 503
        while not serving, 400 for a prompt that does not fit, n / beam_width sequences that
        can never fit the KV pool or the running slots, or a client rid already in flight."""
        if not self.serving:
            raise self.unavailable_error()
        tag, options = None, spec.options
        if tenant is not None and self.tenants is not None:
            options = self.tenants.policy(tenant).apply(options)
            tag = self.tenants.tag(tenant)
        if client_rid is not None and (tenant, client_rid) in self.outputs.by_client_rid:
            raise ApiError(f"request id {client_rid!r} is already in use", param="rid")
        if spec.adapter is not None:
            options = replace(options, lora=self._resolve_lora(spec.adapter))
        all_ids = self.encode(spec) if prompt_ids is None else prompt_ids
        prepared = [self._prepare(spec, ids, i) for i, ids in enumerate(all_ids)]
        events = Outbox()
        groups: dict[str, list[RequestState]] = {}
        messages: list[ToScheduler] = []
        for i, (ids, max_tokens) in enumerate(prepared):
            first = i * spec.n  # the prompt's first output index

            def state(rid: str, j: int, n: int, ids=ids, max_tokens=max_tokens, first=first):
                index, choice = first + j, j if n > 1 else 0
                return self._state(
                    spec,
                    rid,
                    index,
                    choice,
                    n,
                    ids,
                    max_tokens,
                    events,
                    client_rid,
                    tenant,
                    options,
                )

            rid = self._new_rid()
            if spec.beam_width is not None:
                beam = beam_params(self.ready, spec, len(ids), max_tokens)
                messages.append(BeamSearchRequest(rid, ids, beam, tag, options))
                groups[rid] = [state(rid, 0, 1)]
            elif spec.n > 1 and spec.sampling.prompt_logprobs:
                # echo + logprobs: every choice scores the prompt itself (a fork computes it
                # once, without log-probs), so these n go as n independent requests
                for j in range(spec.n):
                    rid = rid if j == 0 else self._new_rid()
                    groups[rid] = [state(rid, j, 1)]
                    params = spec.params(max_tokens, j)
                    messages.append(TokenizedRequest(rid, ids, params, tag, options))
            else:
                check_group_fits(self.ready, spec.n, spec.n_param, len(ids), max_tokens)
                params = spec.request_params(max_tokens)
                messages.append(TokenizedRequest(rid, ids, params, tag, options))
                groups[rid] = [state(rid, j, spec.n) for j in range(spec.n)]
        states = [st for group in groups.values() for st in group]
        try:  # encode all first: a failure leaves nothing behind
            encoded = [self.to_scheduler.codec.encode(m) for m in messages]
        except (msgspec.EncodeError, OverflowError, TypeError) as e:
            logger.exception("could not encode a validated request")
            raise ApiError(f"internal error: {e}", status=500, type="server_error") from e
        self.liveness.on_work_sent(had_work=bool(self.outputs.states))
        self.outputs.add(groups, None if client_rid is None else (tenant, client_rid))
        for data in encoded:  # a failed send fails every registered request (503)
            if not self._send_encoded(data):
                break
        return Generation(states, events, self.abort_states)

    def _resolve_lora(self, name: str) -> LoraRef:
        """The LoraRef of the adapter validation accepted as `name` (404 if it was unloaded
        meanwhile)."""
        try:
            assert self.loras is not None  # validation names only loaded adapters
            return self.loras.resolve(name)
        except UnknownLora as e:
            raise ApiError(str(e), "model", status=404, code="lora_not_found") from e

    def requests_using_lora(self, name: str) -> list[str]:
        """Client-visible ids of the in-flight requests that run under adapter `name`."""
        return sorted(
            {
                st.client_rid or st.rid
                for group in self.outputs.states.values()
                for st in group
                if st.options.lora is not None and st.options.lora.name == name
            }
        )

    def _new_rid(self) -> str:
        """Random: a client must not guess the ids of others' requests."""
        return uuid.uuid4().hex

    def _state(
        self,
        spec: GenerationSpec,
        rid: str,
        index: int,
        choice: int,
        num_choices: int,
        ids: list[int],
        max_tokens: int,
        events: Outbox,
        client_rid: str | None,
        tenant: str | None,
        options: RequestOptions,
    ) -> RequestState:
        """The front's state of output `index` of the HTTP request: choice `choice` of the
        scheduler request `rid` (its own detokenizer and stop strings)."""
        params = spec.params(max_tokens, choice=index % spec.n)
        detok = IncrementalDetokenizer.for_params(self.tokenizer, params, ids, self.token_bytes)
        beam = spec.beam_width is not None
        return RequestState(
            rid,
            index,
            ids,
            params,
            detok,
            events,
            client_rid,
            choice,
            num_choices,
            beam=beam,
            grammar_param=spec.grammar_param,
            options=options,
            field_names={
                "max_tokens": spec.max_tokens_param,
                "prompt": spec.prompt_param,
                # beside n: "stop_regex" or "sampling_params.stop_regex"
                "stop_regex": spec.n_param.removesuffix("n") + "stop_regex",
            },
            tenant=tenant,
        )

    def _prepare(self, spec: GenerationSpec, ids: list[int], index: int) -> tuple[list[int], int]:
        """Token ids and max_tokens of one prompt (its `encode`), checked against the
        context length (vLLM's rule): the prompt must leave room for one token; an explicit
        max_tokens must fit after it; an absent one is the room left (at most the
        default)."""
        assert self.ready is not None
        where = spec.prompt_param if len(spec.prompts) == 1 else f"{spec.prompt_param}[{index}]"
        if spec.truncate_prompt_tokens is not None:
            ids = ids[-spec.truncate_prompt_tokens :]
        try:
            max_tokens = resolve_max_tokens(
                len(ids),
                spec.max_tokens,
                self.ready.max_model_len,
                spec.default_max_tokens,
                prompt=where,
                prompt_param=spec.prompt_param,
                max_tokens_param=spec.max_tokens_param,
            )
        except RequestValueError as e:
            raise ApiError(str(e), e.field) from None
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

    async def flush_cache(self, scope: SaltScope | None = None) -> CacheFlushed:
        """Flush the scheduler's prefix cache (unlocked entries only; `scope`: under one
        tenant's salts only) and wait for its answer; ApiError 503 while not serving."""
        return await self._ask(lambda i: FlushCache(i, scope))

    async def release_cache_holds(self, tenant: str | None, client_ids: list[str]) -> int:
        """End the retention holds of `tenant`'s finished requests known to their client as
        `client_ids` (every scheduler request of each: its children, its prompts); returns
        how many holds ended. Ids of no request of `tenant` that may hold count 0. ApiError
        503 while not serving."""
        if not self.serving:
            raise self.unavailable_error()
        rids = self.held.rids(tenant, client_ids)
        if not rids:
            return 0
        self.held.forget(rids)
        out: CacheHoldsReleased = await self._ask(lambda i: ReleaseCacheHolds(i, rids))
        return out.released

    async def cache_pressure(
        self, scope: SaltScope | None = None, tenant: str | None = None
    ) -> CachePressureRead:
        """The engine's `CachePressure`, read by the scheduler between steps (its `held`: the
        scheduler's ids; `held.client_ids` maps them for a tenant; `scope`: the figures of
        tenant `tenant`'s salts only); ApiError 503 while not serving."""
        tag = None
        if scope is not None and tenant is not None and self.tenants is not None:
            tag = self.tenants.tag(tenant)

        def read(call_id: int) -> ReadCachePressure:
            if scope is not None:
                self._scoped_reads.add(call_id)
            return ReadCachePressure(call_id, scope, tag)

        return await self._ask(read)

    async def _ask(self, message: Callable[[int], ToScheduler]) -> Any:
        """Send `message(call_id)` to the scheduler and wait for its answer with that id
        (`_dispatch`); ApiError 503 while not serving or once the scheduler is gone."""
        if not self.serving:
            raise self.unavailable_error()
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self.calls[call_id] = future
        dead = asyncio.ensure_future(self.dead_event.wait())
        try:
            if not self._send(message(call_id)):
                raise self.unavailable_error()
            await asyncio.wait([future, dead], return_when=asyncio.FIRST_COMPLETED)
            if not future.done():
                raise self.unavailable_error()
            return future.result()
        finally:
            dead.cancel()
            self.calls.pop(call_id, None)

    def abort_states(self, states: list[RequestState]) -> None:
        """Client gone: end these outputs now; the scheduler frees their KV (one abort per
        scheduler request: an n > 1 request's every child)."""
        rids = [st.rid for st in states if not st.finished]
        for st in states:
            if not st.finished:
                self.outputs.finish(st, "abort")
        for rid in dict.fromkeys(rids):
            self._send(AbortRequest(rid))

    def abort_client_rid(self, rid: str, tenant: str | None = None) -> int:
        """/abort: end `tenant`'s unfinished requests with this client rid, or its one
        request without a client rid whose own id (the `id` /generate returned) this is; they
        finish with "abort" when the scheduler confirms. Another tenant's requests are never
        found. Returns how many outputs."""
        pending = self.outputs.unfinished(rid, tenant)
        for r in dict.fromkeys(st.rid for st in pending):
            self._send(AbortRequest(r))
        return len(pending)
