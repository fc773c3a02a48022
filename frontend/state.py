"""ProgramState: the `s` a program receives (text, variables, roles, fork)."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any, overload

from .interpreter import Executor, StreamSink
from .ir import ROLES, ExprLike, RoleBegin, RoleEnd, to_ops


class ProgramState:
    """The state of one running program (or one fork of it).

    `s += expr` appends text / runs gen and select / opens role blocks; `s[name]` reads a
    variable (waiting for a fork's pending operations), raising UnknownVariableError
    (a KeyError) for names never set.
    """

    def __init__(self, executor: Executor) -> None:
        self._executor = executor

    def __iadd__(self, expr: ExprLike) -> ProgramState:
        self._executor.submit(to_ops(expr))
        return self

    def __getitem__(self, name: str) -> str:
        return self._executor.get_variable(name)

    def __contains__(self, name: str) -> bool:
        return name in self._executor.all_variables()

    def meta(self, name: str) -> dict[str, Any]:
        """Details of variable `name`: for a gen finish_reason, prompt_tokens,
        completion_tokens, cached_tokens, output_ids; for a select choices, index, scores
        (the compared values), logprob_sums, token_logprobs, normalize."""
        return self._executor.get_meta(name)

    def tool_calls(self, name: str) -> list[dict[str, Any]]:
        """The calls of gen `name` (one with tool_choice): [{"id", "name", "arguments"}],
        arguments decoded from JSON."""
        return self.meta(name).get("tool_calls", [])

    def variables(self) -> dict[str, str]:
        return self._executor.all_variables()

    def text(self) -> str:
        """The whole text so far (prompt pieces and generated text)."""
        self._executor.sync()
        return self._executor.text

    def messages(self) -> list[dict[str, str]]:
        """The completed role blocks as chat messages [{"role", "content"}]."""
        self._executor.sync()
        return copy.deepcopy(self._executor.messages)

    def fork(self, n: int) -> ForkGroup:
        """n branches that continue from this state; their operations run concurrently
        with each other. Join them with `.join()` (or at program end)."""
        return ForkGroup([ProgramState(e) for e in self._executor.fork(n)], self._executor)

    @contextlib.contextmanager
    def role(self, name: str) -> Iterator[ProgramState]:
        """`with s.role("user"): s += ...` — everything added inside is the message."""
        if name not in ROLES:
            raise ValueError(f"unknown role {name!r}; allowed: {', '.join(ROLES)}")
        self._executor.submit([RoleBegin(name)])
        yield self
        self._executor.submit([RoleEnd(name)])

    def system(self) -> contextlib.AbstractContextManager[ProgramState]:
        return self.role("system")

    def user(self) -> contextlib.AbstractContextManager[ProgramState]:
        return self.role("user")

    def assistant(self) -> contextlib.AbstractContextManager[ProgramState]:
        return self.role("assistant")

    def __repr__(self) -> str:
        ex = self._executor
        return f"ProgramState(variables={sorted(ex.variables)}, text={ex.text[-60:]!r})"


class ForkGroup:
    """The branches of `s.fork(n)`: indexable, iterable; `group["x"]` is every branch's
    variable x; `join()` waits for all branches and raises the first branch error."""

    def __init__(self, states: list[ProgramState], parent: Executor | None = None) -> None:
        self.states = states
        self._parent = parent  # the forked state's executor

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    @overload
    def __getitem__(self, key: int) -> ProgramState: ...
    @overload
    def __getitem__(self, key: str) -> list[str]: ...
    def __getitem__(self, key):
        if isinstance(key, str):
            return [s[key] for s in self.states]
        return self.states[key]

    def __setitem__(self, index: int, state: ProgramState) -> None:
        """Only for `forks[i] += expr`, which assigns the same state back."""
        if state is not self.states[index]:
            raise ValueError("the branches of a fork cannot be replaced")

    def join(self) -> None:
        """Wait for every branch; raise the first error not raised to the program yet. The
        branches' contexts stay held until the parent state's next call, which keeps the
        one it extends (a verdict over the first branch's judgement, say)."""
        errors = [s._executor.finish(self._parent) for s in self.states]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first


class StreamingState:
    """What `program.run(..., stream=True)` returns while the program runs in a thread.

    `text_iter()` yields text as it is appended (one consumer); every other accessor
    waits for the program to finish and raises its error, if any."""

    def __init__(self, state: ProgramState, thread: threading.Thread, sink: StreamSink):
        self._state = state
        self._thread = thread
        self._sink = sink
        self.error: BaseException | None = None  # set by the program thread

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Chunks of text as they arrive: all of the state's text (var_name=None; the
        chunks join to `text()`), or only what gen/select `var_name` produces."""
        for var, chunk in self._sink.chunks():
            if var_name is None or var == var_name:
                yield chunk
        self.wait()

    def wait(self, timeout: float | None = None) -> ProgramState:
        """Wait for the program; returns its final state or raises its error.
        Raises TimeoutError if it is still running after `timeout` seconds."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the program is still running after {timeout} s")
        if self.error is not None:
            raise self.error
        return self._state

    def __getitem__(self, name: str) -> str:
        return self.wait()[name]

    def meta(self, name: str) -> dict[str, Any]:
        return self.wait().meta(name)

    def variables(self) -> dict[str, str]:
        return self.wait().variables()

    def text(self) -> str:
        return self.wait().text()

    def messages(self) -> list[dict[str, str]]:
        return self.wait().messages()
