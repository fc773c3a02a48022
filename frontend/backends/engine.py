"""In-process backend: one background thread owns the Engine (which is not thread-safe).

Callers from any thread submit requests through a queue and wait on futures; the engine
thread adds them, loops `engine.step()` while anything is running (sleeping on the queue
otherwise), forwards text deltas and resolves each request's future when it finishes.
Everything queued is applied in queue order: a hold released (`release_cache_holds`) before
a `run_on_engine` call is gone when that call runs. The engine thread also keeps the engine's
`cache_pressure()` of the latest step (taken before the step's requests are resolved, so a
caller sees whether its own request's context is held), which `cache_pressure` returns
without waiting.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from radixrt.config import holds_back_shared_prefixes
from radixrt.sampling import DEFAULT_OPTIONS, RequestOptions, SamplingParams
from radixrt.stats import CachePressure

from ..errors import BackendError
from .base import Backend, DeltaCallback, GenResult

logger = logging.getLogger(__name__)


@dataclass
class _Submit:
    """Requests added to the engine together (in the same step)."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    options: RequestOptions
    futures: list[Future]
    on_delta: DeltaCallback | None
    lora: str | None = None  # the LoRA adapter's name (None: the base model)


@dataclass
class _Pending:
    future: Future
    on_delta: DeltaCallback | None
    text: list[str] = field(default_factory=list)  # deltas so far
    output_ids: list[int] = field(default_factory=list)  # token ids so far


@dataclass
class _Release:
    """Retention holds to end (`release_cache_holds`)."""

    rids: list[str]


@dataclass
class _Call:
    """A function to run on the engine thread (`run_on_engine`)."""

    fn: Callable[[Any], Any]
    future: Future


_STOP = object()  # queue item that ends the engine thread


class EngineBackend(Backend):
    """Run programs on an in-process `radixrt.Engine`. The backend's thread owns the engine
    from construction until `close()`: do not call the engine from elsewhere meanwhile."""

    releases_holds = True

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        cfg = engine.config
        self.holds_back_shared_prefixes = holds_back_shared_prefixes(
            cfg.scheduler.policy, cfg.cache.prefix_cache
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._close_lock = threading.Lock()
        self._pressure: CachePressure | None = self._read_pressure()  # the engine thread's
        self._thread = threading.Thread(target=self._loop, name="radixrt-frontend-engine")
        self._thread.daemon = True  # a forgotten close() must not hang interpreter exit
        self._thread.start()

    # ---- client side (any thread) ----
    def submit(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        on_delta: DeltaCallback | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
        lora: str | None = None,
    ) -> list[Future]:
        """Queue requests (all with `options`, under LoRA adapter `lora`: a loaded one's name,
        None: the base model) to be added in the same engine step; returns one Future per
        prompt resolving to a GenResult (or raising ValueError, UnknownLora / BackendError)."""
        if self._closed:
            raise BackendError("the EngineBackend is closed")
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        futures: list[Future] = [Future() for _ in prompts]
        submit = _Submit([list(p) for p in prompts], plist, options, futures, on_delta, lora)
        self._inbox.put(submit)
        return futures

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_delta: DeltaCallback | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
        lora: str | None = None,
    ) -> GenResult:
        return self.submit([prompt_ids], params, on_delta, options, lora)[0].result()

    def score_continuations(
        self,
        prefix_ids: list[int],
        continuations: list[list[int]],
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> list[list[float]]:
        params = SamplingParams(
            max_tokens=0,
            prompt_logprobs=True,
            logprob_start_len=max(1, len(prefix_ids)),
        )
        options = RequestOptions(cache_salt=cache_salt)
        prompts = [prefix_ids + c for c in continuations]
        futures = self.submit(prompts, params, options=options, lora=lora)
        return [f.result().prompt_logprobs for f in futures]

    def release_cache_holds(self, rids: list[str]) -> None:
        if rids and not self._closed:
            self._inbox.put(_Release(list(rids)))

    def cache_pressure(self) -> CachePressure | None:
        return self._pressure

    def run_on_engine(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on the engine thread, after everything queued before it (requests
        added, holds released), between steps; returns its result (raises its error). The
        way to touch the engine while this backend owns it: e.g. resetting the cache after
        programs ended, whose holds `release_cache_holds` only queued."""
        if self._closed:
            raise BackendError("the EngineBackend is closed")
        future: Future = Future()
        self._inbox.put(_Call(fn, future))
        return future.result()

    def close(self) -> None:
        """Stop the engine thread; requests still running are aborted and their futures
        fail with BackendError. The engine itself stays usable by the caller."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._inbox.put(_STOP)
        self._thread.join()

    # ---- engine thread ----
    def _loop(self) -> None:
        pending: dict[str, _Pending] = {}
        while True:
            items = [] if pending else [self._inbox.get()]  # idle: sleep until work arrives
            while not self._inbox.empty():
                items.append(self._inbox.get())
            for item in items:
                if item is _STOP:
                    self._fail_all(pending, BackendError("the EngineBackend was closed"))
                    self._fail_unstarted()
                    return
                if isinstance(item, _Release):
                    for rid in item.rids:
                        self.engine.core.release_cache_hold(rid)
                elif isinstance(item, _Call):
                    try:
                        item.future.set_result(item.fn(self.engine))
                    except Exception as e:  # the caller gets its function's error
                        item.future.set_exception(e)
                else:
                    self._add(item, pending)
            if pending:
                self._step(pending)
            elif items:  # holds released (or a call) between steps
                self._pressure = self._read_pressure()

    def _read_pressure(self) -> CachePressure | None:
        read = getattr(self.engine, "cache_pressure", None)  # engines of other makes: None
        return read() if read is not None else None

    def _add(self, sub: _Submit, pending: dict[str, _Pending]) -> None:
        for ids, params, future in zip(sub.prompts, sub.params, sub.futures):
            if not future.set_running_or_notify_cancel():
                continue
            try:
                options = self.engine.with_lora(sub.options, sub.lora)
                rid = self.engine.add_request(ids, params, options=options)
            except Exception as e:  # bad input (ValueError): that caller gets the error
                future.set_exception(e)
                continue
            pending[rid] = _Pending(future, sub.on_delta)

    def _step(self, pending: dict[str, _Pending]) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # an engine bug: fail every waiter rather than hang them
            logger.exception("engine step failed")
            self._fail_all(pending, e)
            return
        self._pressure = self._read_pressure()  # before the callers see their results
        for d, text in outputs:
            p = pending[d.rid]
            p.output_ids += d.new_token_ids
            if text:
                p.text.append(text)
                if p.on_delta is not None:
                    try:
                        p.on_delta(text)
                    except Exception as e:  # the consumer's error ends its request
                        self.engine.abort(d.rid)
                        del pending[d.rid]
                        p.future.set_exception(e)
                        continue
            if d.finished:
                del pending[d.rid]
                p.future.set_result(
                    GenResult(
                        text="".join(p.text),
                        output_ids=p.output_ids,
                        finish_reason=d.finish_reason.value,
                        prompt_tokens=d.prompt_tokens,
                        completion_tokens=d.num_output_tokens,
                        cached_tokens=d.num_cached_tokens,
                        prompt_logprobs=d.prompt_logprobs,
                        rid=d.rid,
                    )
                )

    def _fail_unstarted(self) -> None:
        """Fail submissions that raced with close()."""
        while not self._inbox.empty():
            item = self._inbox.get()
            futures = item.futures if isinstance(item, _Submit) else []
            futures = [item.future] if isinstance(item, _Call) else futures
            for future in futures:
                future.set_exception(BackendError("the EngineBackend was closed"))

    def _fail_all(self, pending: dict[str, _Pending], error: BaseException) -> None:
        for rid, p in pending.items():
            self.engine.abort(rid)
            p.future.set_exception(error)
        pending.clear()


class Runtime(EngineBackend):
    """An EngineBackend that owns its Engine: `Runtime(model_path, **engine_options)`
    (options as for `radixrt.Engine`). `close()` also shuts the engine down."""

    def __init__(self, model_path: str, **engine_options: Any) -> None:
        from radixrt.engine import Engine

        super().__init__(Engine(model_path, **engine_options))

    def close(self) -> None:
        was_open = not self._closed
        super().close()
        if was_open:
            self.engine.shutdown()
