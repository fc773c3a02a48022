"""Release a workload's calls in dependency order (shared by the engine and HTTP drivers)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.workloads import Workload


@dataclass(frozen=True)
class ReadyCall:
    program: int  # index of the program in the workload
    index: int  # index of the call in its program
    prompt: list[int]  # full prompt token ids
    max_tokens: int


class Dispatcher:
    """Tracks which calls may be sent.

    Programs start in workload order, at most `max_concurrency` at a time (None: no limit),
    each not before its arrival time: a Poisson process of `request_rate` programs per second
    (inf: all arrive at 0). A call becomes ready when its parent finished; its prompt is the
    parent's prompt (+ the parent's output when `extends_output`) + its own input ids, built
    when the parent finishes (all children of a call become ready together).
    Not thread-safe: a driver calls it from one loop.
    """

    def __init__(
        self,
        workload: Workload,
        max_concurrency: int | None = None,
        request_rate: float = math.inf,
        seed: int = 0,
    ) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
        if not request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: no pacing), got {request_rate}")
        self.workload = workload
        self.max_concurrency = max_concurrency
        n = len(workload.programs)
        if math.isinf(request_rate):
            self.arrivals = [0.0] * n
        else:
            gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, n)
            self.arrivals = np.cumsum(gaps).tolist()
        self._children = [p.children() for p in workload.programs]
        self._remaining = [len(p.calls) for p in workload.programs]
        self._ready: deque[ReadyCall] = deque()
        self._paused: list[tuple[float, ReadyCall]] = []  # (when it is ready, call)
        self._next_program = 0
        self._active = 0
        self.num_finished_calls = 0

    @property
    def done(self) -> bool:
        return self._next_program == len(self.workload.programs) and self._active == 0

    def pop_ready(self, now: float) -> list[ReadyCall]:
        """Start the programs that arrived by `now` (seconds since the run started) and have a
        free slot; return every call that is ready and not returned before."""
        programs = self.workload.programs
        while (
            self._next_program < len(programs)
            and self.arrivals[self._next_program] <= now
            and (self.max_concurrency is None or self._active < self.max_concurrency)
        ):
            p = self._next_program
            self._next_program += 1
            self._active += 1
            for i, call in enumerate(programs[p].calls):
                if call.parent is None:
                    self._ready.append(ReadyCall(p, i, list(call.input_ids), call.max_tokens))
        ready = list(self._ready)
        self._ready.clear()
        if self._paused:
            ready += [c for t, c in self._paused if t <= now]
            self._paused = [(t, c) for t, c in self._paused if t > now]
        return ready

    def next_arrival(self) -> float | None:
        """When the next program may start (if one is left and a slot is free) or the next
        paused call becomes ready, whichever is first."""
        times = [t for t, _ in self._paused]
        if self._next_program < len(self.workload.programs) and (
            self.max_concurrency is None or self._active < self.max_concurrency
        ):
            times.append(self.arrivals[self._next_program])
        return min(times) if times else None

    def finish(self, call: ReadyCall, output_ids: Sequence[int], now: float = 0.0) -> None:
        """Record that `call` finished with `output_ids` at `now`; its children become ready
        (a child with a pause at now + its pause)."""
        if len(output_ids) != call.max_tokens:
            raise RuntimeError(
                f"program {call.program} call {call.index}: got {len(output_ids)} output "
                f"tokens, expected {call.max_tokens} (ignore_eos); lengths would differ "
                "between configurations"
            )
        program = self.workload.programs[call.program]
        for k in self._children[call.program][call.index]:
            child = program.calls[k]
            context = call.prompt + list(output_ids) if child.extends_output else call.prompt
            ready = ReadyCall(call.program, k, context + list(child.input_ids), child.max_tokens)
            if child.pause_s > 0:
                self._paused.append((now + child.pause_s, ready))
            else:
                self._ready.append(ready)
        self.num_finished_calls += 1
        self._remaining[call.program] -= 1
        if self._remaining[call.program] == 0:
            self._active -= 1
