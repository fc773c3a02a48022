"""`@function` programs: run, run_batch (with a shared-prefix hint), streaming."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import fields
from typing import Any

from .admission import BatchAdmission
from .backends.base import Backend, adapter_kw
from .interpreter import Executor, StreamSink, TraceStop, program_hold_s
from .ir import GenParams
from .state import ProgramState, StreamingState

_default_backend: Backend | None = None
MAX_BATCH_THREADS = 64  # run_batch threads when num_threads is not given


def set_default_backend(backend: Backend | None) -> None:
    """The backend programs use when run/run_batch get no `backend=`."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


def function(func: Callable[..., None]) -> Program:
    """Decorator: `func(s, *args, **kwargs)` becomes a Program (`.run`, `.run_batch`).
    Calling the Program with a state runs its body on that state (programs compose)."""
    return Program(func)


class Program:
    def __init__(self, func: Callable[..., None]) -> None:
        self.func = func
        functools.update_wrapper(self, func)

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> None:
        self.func(s, *args, **kwargs)

    def run(
        self,
        *args: Any,
        backend: Backend | None = None,
        stream: bool = False,
        gen_defaults: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> ProgramState | StreamingState:
        """Run the program once and return its final state (every fork joined).

        gen_defaults: gen() options for gens that leave them unset, e.g.
        {"temperature": 0, "max_tokens": 32}. The program's context stays cached between
        its calls while it runs (a retention hint on every gen and sent prefix that sets no
        `cache_ttl_s`: `PROGRAM_CACHE_TTL_S`, on backends that release holds early: the
        in-process one, and a radixrt server's), released when it ends, also by an error;
        `{"cache_ttl_s": 0}` turns that off. stream=True returns a StreamingState at once
        (the program runs in a thread); iterate `text_iter()` and/or `wait()`.
        Errors of the program (or of a fork) are raised here (stream: from text_iter/wait).
        """
        backend, defaults = _backend(backend), _gen_defaults(gen_defaults)
        if not stream:
            return self._run(Executor(backend, defaults), args, kwargs)
        sink = StreamSink()
        executor = Executor(backend, defaults, sink=sink)

        def target() -> None:
            try:
                self._run(executor, args, kwargs)
            except BaseException as e:  # handed to the consumer by text_iter/wait
                result.error = e
            finally:
                sink.end()

        thread = threading.Thread(target=target, name="radixrt-program", daemon=True)
        result = StreamingState(ProgramState(executor), thread, sink)
        thread.start()
        return result

    def _run(self, executor: Executor, args: tuple, kwargs: dict[str, Any]) -> ProgramState:
        state = ProgramState(executor)
        gate = executor.gate
        try:
            if gate is not None:
                gate.start()  # run_batch's admission: when its context is likely to be kept
            self.func(state, *args, **kwargs)
        finally:
            # joins the forks even when the body failed and releases the program's holds
            error = executor.finish()
            if gate is not None:
                gate.end()
        if error is not None:
            raise error
        return state

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | None = None,
        progress_bar: bool = False,
        gen_defaults: dict[str, Any] | None = None,
        prefix_hint: bool = True,
        admission: bool = True,
    ) -> list[ProgramState]:
        """Run the program once per kwargs dict, `num_threads` at a time (default: all, up
        to 64), and return the final states in input order. If any program fails, the
        others still finish and the first failure (in input order) is raised.

        prefix_hint: trace every program up to its first gen/select (running its Python
        code up to there without calling the model), and prefill the token prefix common
        to all of them once before the batch, so every program hits the prefix cache (held
        while the batch runs, as a program holds its context: `PROGRAM_CACHE_TTL_S`).
        Turn it off for programs with side effects before their first gen. An error the
        traced code raises is raised here, before any program runs.

        admission: on backends that report their cache pressure (`Backend.cache_pressure`:
        the in-process one, and a radixrt server's) and programs that hold their contexts,
        finish the programs under way before starting (or going on with) those whose
        contexts the engine's retention share cannot keep: a program whose latest hold was
        refused waits before its next call, and new programs wait to start, until the held
        programs of the batch end and their holds make room (`radixrt.frontend.admission`).
        Off: every program runs as soon as a thread is free.
        """
        if not all(isinstance(kw, dict) for kw in batch_kwargs):
            raise ValueError("run_batch takes a list of keyword-argument dicts, one per run")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1, got {num_threads!r}")
        backend = _backend(backend)
        defaults = _gen_defaults(gen_defaults)
        if not batch_kwargs:
            return []
        held: list[str] = []  # the batch's shared prefix, held while the batch runs
        hold_s = program_hold_s(backend, defaults)
        shared = 0  # tokens of it
        if prefix_hint and len(batch_kwargs) > 1:
            prefix = self._common_prefix_ids(backend, defaults, batch_kwargs)
            if prefix:
                sent = backend.cache_prefix(
                    prefix,
                    defaults.cache_salt if defaults else None,
                    hold_s,
                    **adapter_kw(defaults.lora if defaults else None),
                )
                if hold_s > 0 and sent.rid is not None:
                    held.append(sent.rid)
                    shared = len(prefix)
        gates = None
        if admission and hold_s > 0 and backend.cache_pressure() is not None:
            gates = BatchAdmission(backend, shared)
        from tqdm.auto import tqdm

        threads = num_threads or min(len(batch_kwargs), MAX_BATCH_THREADS)
        try:
            with ThreadPoolExecutor(threads, thread_name_prefix="radixrt-batch") as pool:
                futures = {
                    pool.submit(
                        self._run,
                        Executor(backend, defaults, gate=gates and gates.program(i)),
                        (),
                        kw,
                    ): i
                    for i, kw in enumerate(batch_kwargs)
                }
                with tqdm(
                    total=len(futures), disable=not progress_bar, desc=self.func.__name__
                ) as bar:
                    for _ in as_completed(futures):
                        bar.update(1)
        finally:
            if held:
                backend.release_cache_holds(held)
        ordered = sorted(futures, key=futures.__getitem__)
        for i, future in enumerate(ordered):
            error = future.exception()
            if error is not None:
                if hasattr(error, "add_note"):
                    error.add_note(f"(in run_batch item {i}: {batch_kwargs[i]!r})")
                raise error
        return [f.result() for f in ordered]

    def trace_prefix(self, backend: Backend, defaults: GenParams | None, kwargs: dict) -> str:
        """The text a run with `kwargs` builds before its first gen/select/read/fork."""
        executor = Executor(backend, defaults, tracing=True)
        with contextlib.suppress(TraceStop):  # the first model call ends the prefix
            self.func(ProgramState(executor), **kwargs)
        return executor.text

    def _common_prefix_ids(
        self, backend: Backend, defaults: GenParams | None, batch: Sequence[dict]
    ) -> list[int]:
        prefixes = [backend.encode(self.trace_prefix(backend, defaults, kw)) for kw in batch]
        common = prefixes[0]
        for ids in prefixes[1:]:
            n = next((i for i, (a, b) in enumerate(zip(common, ids)) if a != b), None)
            common = common[: min(len(common), len(ids)) if n is None else n]
        return common


def _backend(backend: Backend | None) -> Backend:
    backend = backend or _default_backend
    if backend is None:
        raise ValueError(
            "no backend: pass backend=... (EngineBackend, Runtime or RuntimeEndpoint) or "
            "call radixrt.frontend.set_default_backend(...) first"
        )
    return backend


def _gen_defaults(values: dict[str, Any] | None) -> GenParams | None:
    if values is None:
        return None
    allowed = {f.name for f in fields(GenParams)}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ValueError(f"unknown gen_defaults {unknown}; allowed: {', '.join(sorted(allowed))}")
    return GenParams(**values)
