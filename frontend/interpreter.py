"""The interpreter: runs one program state's operations, in order, against a backend.

A state's executor runs operations either in the caller's thread (`concurrent=False`: the
main state of a program) or on its own worker thread (`concurrent=True`: forks, so the
branches' gens reach the backend together and are batched). A worker records the first
error, skips the operations after it, and the error is raised at the next sync point
(reading a variable or the text, fork, join, program end).
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .admission import ProgramGate
from .backends.base import Backend, GenResult, adapter_kw
from .errors import UnknownVariableError
from .ir import Gen, GenParams, OfferTools, Op, RoleBegin, RoleEnd, Select, Text
from .tool_calls import constrained, read_calls

# A program holds its context between its calls this long at most (each gen's and each sent
# prefix's `cache_ttl_s`) when its gens leave `cache_ttl_s` unset and the backend can release
# holds early: the program releases them when it ends, so the time only bounds a program that
# never gets there (its process died)
PROGRAM_CACHE_TTL_S = 60.0


def program_hold_s(backend: Backend, gen_defaults: GenParams | None) -> float:
    """The retention hint of a program's gens and prefixes that set none: the program's
    `gen_defaults` cache_ttl_s, else PROGRAM_CACHE_TTL_S where the backend releases holds
    early, else 0 (nothing held)."""
    if gen_defaults is not None and gen_defaults.cache_ttl_s is not None:
        return gen_defaults.cache_ttl_s
    return PROGRAM_CACHE_TTL_S if backend.releases_holds else 0.0


class TraceStop(BaseException):
    """Raised inside a traced program at its first operation that needs the model
    (internal to run_batch's prefix tracing; BaseException so `except Exception` in a
    program does not catch it)."""


class StreamSink:
    """Text chunks of one program as they are appended, for `text_iter`. Thread-safe."""

    _END = object()

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, var: str | None, chunk: str) -> None:
        self._queue.put((var, chunk))

    def end(self) -> None:
        self._queue.put(self._END)

    def chunks(self):
        """Yield (variable or None, chunk) until `end()`; one consumer only."""
        while (item := self._queue.get()) is not self._END:
            yield item


@dataclass
class _OpenRole:
    role: str
    content_start: int  # offset in the state's text where the message content begins


class Executor:
    """Holds one program state (text, variables, meta, messages) and runs its operations.

    Not shared between threads except through `submit`/`sync`/`finish` (and the reads after
    `sync`). `tracing=True` runs no model call: it stops (TraceStop) at the first gen,
    select, variable read or fork and keeps the text built so far.
    """

    def __init__(
        self,
        backend: Backend,
        gen_defaults: GenParams | None,
        *,
        concurrent: bool = False,
        sink: StreamSink | None = None,
        tracing: bool = False,
        gate: ProgramGate | None = None,
    ) -> None:
        self.backend = backend
        self.gen_defaults = gen_defaults
        # the program's cache salt (gen_defaults), for what it sends besides gens (select
        # scoring, prefix prefills)
        self.cache_salt = gen_defaults.cache_salt if gen_defaults is not None else None
        # the program's LoRA adapter (gen_defaults), likewise: a prefix is cached per adapter
        self.lora = gen_defaults.lora if gen_defaults is not None else None
        self.sink = sink
        self.tracing = tracing
        self.text = ""
        self.variables: dict[str, str] = {}
        self.meta: dict[str, dict[str, Any]] = {}
        self.messages: list[dict[str, str]] = []
        self.open_role: _OpenRole | None = None
        self.tools: tuple[dict, ...] = ()  # offered to the model (tools(...))
        self.children: list[Executor] = []  # forks, finished with this executor
        # the retention hint of gens and sent prefixes that set none (program_hold_s)
        self.hold_s = program_hold_s(backend, gen_defaults)
        # this state's requests with a retention hint (gens, sent prefixes): their holds end
        # when it finishes (a fork's at its join: nothing continues a joined branch; the
        # program's main state's at the program's end)
        self.held_rids: list[str] = []
        # run_batch's admission (None: a program run alone): its calls with a retention hint
        # go through the gate, which reads whether the latest of `held_calls` is held
        self.gate = gate
        # (request id, context tokens), in order; a fork's branches start with a prefix hint
        # still in flight as its Future (the gate counts its hold as in place)
        self.held_calls: list[tuple[str | Future, int]] = []
        # a prefix hint sent without waiting (`_send_prefix(wait=False)`): its hold joins the
        # state's, and its error is raised, at the state's next call or sync point
        self._hint: Future | None = None
        # joined branches' latest held calls (request id, context tokens, branch text), kept
        # until this state's next call: the one whose text that call's context extends
        # becomes this state's held context, the others are released (`_take_joined`); a
        # fork or the state's end releases them all
        self._joined: list[tuple[str, int, str]] = []
        self._joined_lock = threading.Lock()
        # len(text) right after the latest gen appended its output (-1: none yet): while the
        # text has not grown since, the backend has computed all of it but the output's last
        # token (the gen's context, held with it), and a fork sends no prefix hint
        self._generated_to = -1
        self._error: BaseException | None = None  # first error of the worker
        self._error_raised = False  # raised to the program at a sync point already
        self._finished = False
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if concurrent:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._work, name="radixrt-fork", daemon=True)
            self._thread.start()

    # ---- control ----
    def submit(self, ops: list[Op]) -> None:
        """Run `ops` now (in this thread) or queue them for the worker."""
        self._check_open()
        if self._queue is None:
            for op in ops:
                self._execute(op)
        else:
            self._raise_error()
            self._queue.put(ops)

    def sync(self) -> None:
        """Wait until every submitted operation ran and the prefix hint in flight is back;
        raise the first error (the hint's first)."""
        if self._queue is not None and not self._finished:
            self._queue.join()
        self._await_hint()
        self._raise_error()

    def finish(self, parent: Executor | None = None) -> BaseException | None:
        """Wait for the queued operations and for every fork, stop the worker, release the
        state's retention holds; returns the first error of this state or its forks that the
        program has not seen yet (None if there is none). So every error is raised once at
        least: a program that catches a fork's error (from join or a read) can go on.
        `parent`: the state this branch joins into, which keeps the branch's latest held
        context until its own next call (`_take_joined`)."""
        if self._finished:
            return None
        if self._queue is not None:
            self._queue.put(None)
            self._thread.join()  # type: ignore[union-attr]
        self._finished = True
        own = None if self._error_raised else self._error
        try:
            self._await_hint()
        except BaseException as e:  # the program has not seen it
            own = e if own is None else own
        errors = [own] + [child.finish() for child in self.children]
        self._release_joined()
        if parent is not None and self.held_calls and own is None:
            rid, tokens = self.held_calls[-1]
            if isinstance(rid, str) and rid in self.held_rids and parent._adopt(rid, tokens, self):
                self.held_rids.remove(rid)
        if self.held_rids:
            self.backend.release_cache_holds(self.held_rids)
            self.held_rids = []
        return next((e for e in errors if e is not None), None)

    # ---- joined branches' holds ----
    def _adopt(self, rid: str, tokens: int, branch: Executor) -> bool:
        """Keep a joined branch's latest held context until this state's next call; False
        when this state has ended (the branch releases it)."""
        with self._joined_lock:
            if self._finished:
                return False
            self._joined.append((rid, tokens, branch.text))
            return True

    def _take_joined(self) -> None:
        """Before a call from this state: the joined branch context that its text extends
        (the longest) becomes a held call of this state; the other joined ones are
        released."""
        with self._joined_lock:
            joined, self._joined = self._joined, []
        if not joined:
            return
        fits = [j for j in joined if self.text.startswith(j[2])]
        best = max(fits, key=lambda j: len(j[2]), default=None)
        if best is not None:
            self.held_rids.append(best[0])
            self.held_calls.append((best[0], best[1]))
        rest = [rid for rid, _, _ in joined if best is None or rid != best[0]]
        if rest:
            self.backend.release_cache_holds(rest)

    def _release_joined(self) -> None:
        with self._joined_lock:
            joined, self._joined = self._joined, []
        if joined:
            self.backend.release_cache_holds([rid for rid, _, _ in joined])

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError(
                "this fork was joined; add to the parent state or fork again"
                if self._queue is not None
                else "the program has finished; its state is read-only (start another run)"
            )

    def fork(self, n: int) -> list[Executor]:
        """n concurrent copies of this state. The shared prefix is sent first (max_tokens=0)
        so that it is computed once: the branches start when it is cached, or at once where
        the backend holds back requests whose uncached prefix another one computes (their
        first requests wait there for the hint's; an uncached part shorter than the server's
        in-batch threshold is not held back and each branch computes it). Right after a gen
        nothing is sent: that gen computed the prefix."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork needs a number of branches >= 1, got {n!r}")
        if self.tracing:
            raise TraceStop
        self._check_open()
        self.sync()
        self._take_joined()  # the fork's prefix (or the branches' calls) extends it, if any
        prefix_ids = self.backend.encode(self.text) if self.text else []
        if n > 1 and prefix_ids and len(self.text) != self._generated_to:
            self._send_prefix(
                prefix_ids, self.lora, wait=not self.backend.holds_back_shared_prefixes
            )
        children = []
        for _ in range(n):
            child = Executor(self.backend, self.gen_defaults, concurrent=True, gate=self.gate)
            child.hold_s = self.hold_s
            child.held_calls = list(self.held_calls)
            if self._hint is not None:  # the branches' context: the hint's, held soon
                child.held_calls.append((self._hint, len(prefix_ids)))
            child.text = self.text
            child._generated_to = self._generated_to
            child.variables = dict(self.variables)
            child.meta = copy.deepcopy(self.meta)
            child.messages = copy.deepcopy(self.messages)
            child.open_role = copy.copy(self.open_role)
            child.tools = self.tools
            children.append(child)
        self.children += children
        return children

    def get_variable(self, name: str) -> str:
        if self.tracing:
            raise TraceStop
        self.sync()
        if name not in self.variables:
            raise UnknownVariableError(name, sorted(self.variables))
        return self.variables[name]

    def all_variables(self) -> dict[str, str]:
        if self.tracing:
            raise TraceStop
        self.sync()
        return dict(self.variables)

    def get_meta(self, name: str) -> dict[str, Any]:
        if self.tracing:
            raise TraceStop
        self.sync()
        if name not in self.meta:
            raise UnknownVariableError(name, sorted(self.meta))
        return self.meta[name]

    def _work(self) -> None:
        assert self._queue is not None
        while (ops := self._queue.get()) is not None:
            if self._error is None:
                try:
                    for op in ops:
                        self._execute(op)
                except BaseException as e:  # kept and raised at the next sync point
                    self._error = e
            self._queue.task_done()
        self._queue.task_done()

    def _raise_error(self) -> None:
        if self._error is not None:
            self._error_raised = True
            raise self._error

    # ---- operations ----
    def _execute(self, op: Op) -> None:
        if isinstance(op, Text):
            self._append(op.value, None, stream=True)
        elif isinstance(op, Gen):
            self._gen(op)
        elif isinstance(op, Select):
            self._select(op)
        elif isinstance(op, RoleBegin):
            self._role_begin(op.role)
        elif isinstance(op, RoleEnd):
            self._role_end(op.role, op.call_id)
        elif isinstance(op, OfferTools):
            if self.messages or self.open_role is not None:
                raise ValueError(
                    "tools(...) goes before the first role (the template renders them)"
                )
            self.tools = op.tools
        else:
            raise AssertionError(f"unknown operation {op!r}")

    def _append(self, text: str, var: str | None, stream: bool) -> None:
        self.text += text
        if stream and self.sink is not None and text:
            self.sink.put(var, text)

    def _gen(self, op: Gen) -> None:
        if self.tracing:
            raise TraceStop
        params = op.params.resolve(self.gen_defaults)
        options = op.params.options(self.gen_defaults)
        if op.params.cache_ttl_s is None and options.cache_ttl_s != self.hold_s:
            options = dataclasses.replace(options, cache_ttl_s=self.hold_s)  # the program's hold
        fmt = None
        if op.tool_choice is not None:
            if not self.tools:
                raise ValueError(
                    f"gen({op.name!r}) has a tool_choice but no tools(...) were offered"
                )
            template = getattr(self.backend.chat_template.tokenizer, "chat_template", None)
            params, fmt = constrained(
                params, self.tools, op.tool_choice, op.parallel_tool_calls, template
            )
        if not self.text:
            raise ValueError(f"gen({op.name!r}) needs text before it (the prompt is empty)")
        prompt_ids = self.backend.encode(self.text)
        on_delta = None
        if self.sink is not None:
            sink, name = self.sink, op.name
            on_delta = lambda chunk: sink.put(name, chunk)  # noqa: E731
        tokens = len(prompt_ids) + (params.max_tokens or 0)
        adapter = adapter_kw(op.params.adapter(self.gen_defaults))
        result = self._call(
            options.cache_ttl_s,
            tokens,
            lambda: self.backend.generate(prompt_ids, params, on_delta, options=options, **adapter),
        )
        self._append(result.text, op.name, stream=False)  # streamed piecewise above
        self._generated_to = len(self.text)
        if op.name is not None:
            self.variables[op.name] = result.text
            calls: list[dict[str, Any]] = []
            if fmt is not None:
                self.variables[op.name], calls = read_calls(fmt, result.text)
            self.meta[op.name] = {
                "tool_calls": calls,
                "finish_reason": result.finish_reason,
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
                "cached_tokens": result.cached_tokens,
                "output_ids": result.output_ids,
            }

    def _select(self, op: Select) -> None:
        if self.tracing:
            raise TraceStop
        if not self.text:
            raise ValueError(f"select({op.name!r}) needs text before it (nothing to score on)")
        prefix_ids = self.backend.encode(self.text)
        choice_ids = [self.backend.encode_continuation(c) for c in op.choices]
        # always after the hint: the server does not hold back requests whose shared uncached
        # part is short (radixrt.scheduler.policy.IN_BATCH_PREFIX_THRESHOLD), as a select's
        # tail after a cached context often is, and each scoring would compute it
        lora = op.lora if op.lora is not None else self.lora
        self._send_prefix(prefix_ids, lora)
        token_logprobs = self.backend.score_continuations(
            prefix_ids, choice_ids, self.cache_salt, **adapter_kw(lora)
        )
        sums = [sum(lps) for lps in token_logprobs]
        scores = [s / len(lps) for s, lps in zip(sums, token_logprobs)] if op.normalize else sums
        best = max(range(len(scores)), key=scores.__getitem__)  # first of equal maxima
        choice = op.choices[best]
        self._append(choice, op.name, stream=True)
        if op.name is not None:
            self.variables[op.name] = choice
            self.meta[op.name] = {
                "choices": list(op.choices),
                "index": best,
                "scores": scores,
                "logprob_sums": sums,
                "token_logprobs": token_logprobs,
                "normalize": op.normalize,
            }

    def _send_prefix(self, prefix_ids: list[int], lora: str | None, wait: bool = True) -> None:
        """Prefill the state's prefix (held for the program, as its gens' contexts) under
        LoRA adapter `lora` (None: the base model's KV). `wait=False`: sent from a thread of
        its own while the state goes on; its hold joins the state's at the state's next call
        or sync point (`_await_hint`)."""
        hold_s, tokens, adapter = self.hold_s, len(prefix_ids), adapter_kw(lora)
        send = lambda: self.backend.cache_prefix(prefix_ids, self.cache_salt, hold_s, **adapter)  # noqa: E731
        if wait:
            self._call(hold_s, tokens, send)
            return
        self._await_hint()  # one hint in flight at most
        hint: Future = Future()

        def run() -> None:
            try:
                hint.set_result(self._send(hold_s, tokens, send))
            except BaseException as e:  # raised at the state's next call or sync point
                hint.set_exception(e)

        self._hint = hint
        threading.Thread(target=run, name="radixrt-prefix-hint", daemon=True).start()

    def _await_hint(self) -> None:
        """Wait for the prefix hint in flight, if any, and add its hold to the state's;
        raises the hint's error."""
        hint, self._hint = self._hint, None
        if hint is not None:
            self._hold(self.hold_s, hint.result())

    def _call(self, cache_ttl_s: float, tokens: int, send) -> GenResult:
        """Send a request (`send()`) whose context is `tokens` long after the prefix hint in
        flight (`_await_hint`); with a retention hint, through the admission gate (when
        run_batch has one) and remembered for release at the program's end."""
        self._await_hint()
        self._take_joined()
        result = self._send(cache_ttl_s, tokens, send)
        self._hold(cache_ttl_s, result)
        return result

    def _send(self, cache_ttl_s: float, tokens: int, send) -> GenResult:
        """`send()`; with a retention hint, through the admission gate (when run_batch has
        one). Reads `held_calls`, changes nothing of the state (the prefix hint's thread
        runs it)."""
        if cache_ttl_s <= 0 or self.gate is None:
            return send()
        reservation = self.gate.before_call(self.held_calls, tokens)
        result = None
        try:
            result = send()
        finally:
            n = tokens if result is None else result.prompt_tokens + result.completion_tokens
            self.gate.after_call(reservation, result, n)
        return result

    def _hold(self, cache_ttl_s: float, result: GenResult) -> None:
        """Remember a call sent with a retention hint for release at the program's end."""
        if cache_ttl_s > 0 and result.rid is not None:
            self.held_rids.append(result.rid)
            self.held_calls.append((result.rid, result.prompt_tokens + result.completion_tokens))

    def _role_begin(self, role: str) -> None:
        if self.open_role is not None:
            raise ValueError(
                f"cannot open a {role!r} block inside the open {self.open_role.role!r} "
                "block; roles do not nest"
            )
        prefix = self.backend.chat_template.prefix(self.messages, role, self.tools)
        self._append(prefix, None, stream=True)
        self.open_role = _OpenRole(role, len(self.text))

    def _role_end(self, role: str, call_id: str | None = None) -> None:
        assert self.open_role is not None and self.open_role.role == role, (role, self.open_role)
        content = self.text[self.open_role.content_start :]
        suffix = self.backend.chat_template.suffix(self.messages, role, self.tools)
        self._append(suffix, None, stream=True)
        message = {"role": role, "content": content}
        if call_id is not None:
            message["tool_call_id"] = call_id
        self.messages.append(message)
        self.open_role = None
