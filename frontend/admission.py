"""run_batch's admission: finish the programs under way rather than start (or go on with)
programs whose contexts the engine cannot keep.

A program holds its context between its calls (retention hints), but the engine keeps holds
only within a share of its KV pool (`retention_max_share`): the oldest programs' holds stay,
a younger program's next hold is refused when the share is full, and its context is then an
ordinary cache entry that the other programs' work evicts before its next call. With more
programs under way than their contexts fit, most of them lose their contexts between calls
(LRU's cyclic pattern). Finishing the held programs first (the depth-first order of the
SGLang paper's argument) loses nothing: they release their holds at their end, and the
programs that waited go on then.

The engine reports its holds as data (`Backend.cache_pressure()`: blocks held, the share
bound, which requests' holds are in place), read between calls:
- a program whose latest call's context is held goes on at once;
- one whose latest hold was refused (or given up for room) waits before its next call while
  the blocks that call would add to its hold do not fit under the share bound, as long as
  another program of the batch that holds a context is under way (it will release it);
- a new program starts only when no program waits to go on and its first hold would fit
  (as large as the largest first hold of the batch so far), with the same proviso;
- the waiters go oldest first (programs that go on before programs that start), and what a
  program let go will add is counted as taken until its call is back.
So a batch never stalls: when no other program holding a context runs, the first waiter goes.
"""

from __future__ import annotations

import itertools
import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from .backends.base import Backend, GenResult

POLL_S = 0.01  # the first waiter's re-read of the engine's pressure (it changes per step)


@dataclass
class _Program:
    index: int  # start order: lower is older
    rids: set[str] = field(default_factory=set)  # its calls' requests that asked for a hold
    waiting: int = 0  # its executors waiting in the gate
    first_blocks: int = 0  # blocks of its first held call (0: none yet)
    age: float = math.inf  # order of its first held call: the engine's lineage age
    own: int = 0  # blocks of its latest held context that the batch does not share
    growth: int = 0  # blocks its latest held call added
    done: bool = False


@dataclass(order=True)
class _Waiter:
    key: tuple[int, int, int]  # (0 go on | 1 start, program index, arrival)
    program: _Program = field(compare=False)
    need: int = field(compare=False)  # blocks it would add to the held ones
    held: bool = field(compare=False)  # the program's latest context is held


class BatchAdmission:
    """One run_batch's gate (thread-safe); `program(i)` is program i's handle."""

    def __init__(self, backend: Backend, shared_tokens: int = 0) -> None:
        self.backend = backend
        self.shared_tokens = shared_tokens  # the batch's common prefix (held once for all)
        self._cond = threading.Condition()
        self._programs: dict[int, _Program] = {}
        self._waiters: list[_Waiter] = []
        self._reserved: dict[int, int] = {}  # by waiter id: blocks let go, call not back yet
        self._arrivals = itertools.count()
        self._first_blocks = 0  # the largest first hold of a program of the batch
        self._ages = itertools.count()
        self.waits = 0  # calls and starts that waited (for tests and reports)

    def program(self, index: int) -> ProgramGate:
        return ProgramGate(self, index)

    # ---- gate ----
    def _enter(self, program: _Program, need: int, start: bool, held: bool = False) -> int | None:
        """Block until `program` may send a call (or start) that adds `need` blocks to the
        held ones; returns the reservation to clear when the call is back (None: none)."""
        with self._cond:
            key = (int(start), program.index, next(self._arrivals))
            me = _Waiter(key, program, need, held)
            self._waiters.append(me)
            program.waiting += 1
            self._cond.notify_all()  # a program that waits no longer runs
            waited = False
            try:
                while True:
                    head = min(self._waiters)
                    if head is me and self._may_go(me):
                        break
                    waited = True
                    # only the first waiter re-reads the pressure; the rest wait for a change
                    self._cond.wait(POLL_S if head is me else None)
            finally:
                self._waiters.remove(me)
                program.waiting -= 1
                self._cond.notify_all()
            self.waits += waited
            if need <= 0:
                return None
            key = next(self._arrivals)
            self._reserved[key] = need
            return key

    def _may_go(self, me: _Waiter) -> bool:
        pressure = self.backend.cache_pressure()
        if pressure is None or me.need <= 0 or me.need > pressure.max_held_blocks:
            return True  # nothing to tell, nothing held, or never held: waiting gains nothing
        held, mine = pressure.held, me.program
        holding = [
            p for p in self._programs.values()
            if p is not mine and not p.done and not p.rids.isdisjoint(held)
        ]  # fmt: skip
        if me.held:
            # its hold keeps its lineage's age: it fits when the older lineages' holds, after
            # their next calls, leave room for it (younger ones give way to it)
            holding = [p for p in holding if p.age < mine.age]
            shared = math.ceil(self.shared_tokens / pressure.block_size)
            ahead = shared + sum(p.own + p.growth for p in holding)
            if ahead + mine.own + me.need <= pressure.max_held_blocks:
                return True
        elif me.need <= pressure.room_blocks - sum(self._reserved.values()):
            return True
        # wait only while another program of the batch that holds a context runs
        return not any(p.waiting == 0 for p in holding)

    def _back(self, reservation: int | None) -> None:
        if reservation is not None:
            with self._cond:
                self._reserved.pop(reservation, None)
                self._cond.notify_all()


class ProgramGate:
    """One program's side of the gate, shared by its executors (its forks')."""

    def __init__(self, admission: BatchAdmission, index: int) -> None:
        self.admission = admission
        self.state = _Program(index)
        self._started: int | None = None  # the start's reservation, until its first call

    def start(self) -> None:
        """Block until the program may start (before its first operation)."""
        adm = self.admission
        with adm._cond:
            adm._programs[self.state.index] = self.state
        self._started = adm._enter(self.state, adm._first_blocks, start=True)

    def before_call(self, held_calls: list[tuple[str | Future, int]], tokens: int) -> int | None:
        """Before a call with a retention hint whose context is `tokens` long (prompt and
        output), from an executor whose earlier held calls are `held_calls` ((request id,
        context tokens), oldest first; a fork's prefix hint is its Future, held while in
        flight): block while the call should wait (module docstring); returns the
        reservation for `after_call`."""
        if not held_calls:
            return None  # the program's first call: it started through the gate
        pressure = self.admission.backend.cache_pressure()
        if pressure is None:
            return None

        def in_place(rid: str | Future) -> bool:
            if isinstance(rid, Future):  # a fork's prefix hint: held once it is back
                if not rid.done():
                    return True  # the branches extend the hold it is taking
                if rid.exception() is not None:
                    return False
                rid = rid.result().rid
            return rid in pressure.held

        base = next((n for rid, n in reversed(held_calls) if in_place(rid)), 0)
        bs = pressure.block_size
        need = math.ceil(tokens / bs) - base // bs  # blocks its hold would add
        held = in_place(held_calls[-1][0])
        return self.admission._enter(self.state, need, start=False, held=held)

    def after_call(self, reservation: int | None, result: GenResult | None, tokens: int) -> None:
        """A call sent with a retention hint is back (`tokens`: its context's length; no
        result: it failed)."""
        adm = self.admission
        if result is not None and result.rid is not None:
            pressure = adm.backend.cache_pressure()  # outside the lock: it may be a GET
            with adm._cond:
                state = self.state
                state.rids.add(result.rid)
                own = max(1, tokens - adm.shared_tokens)  # what the batch does not share
                own = 0 if pressure is None else math.ceil(own / pressure.block_size)
                if not state.first_blocks and own:
                    state.first_blocks = own
                    adm._first_blocks = max(adm._first_blocks, own)
                if pressure is not None and result.rid in pressure.held:
                    if state.age == math.inf:
                        state.age = next(adm._ages)
                    state.growth, state.own = max(0, own - state.own), max(own, state.own)
        adm._back(reservation)
        adm._back(self._started)
        self._started = None

    def end(self) -> None:
        """The program ended (its holds released)."""
        adm = self.admission
        adm._back(self._started)
        self._started = None
        with adm._cond:
            self.state.done = True
            self.state.rids.clear()
            adm._cond.notify_all()
