"""run_batch's admission (`radixrt.frontend.admission`): the gate's rules on a backend whose
cache pressure the test sets, and a batch of chains on an engine whose retention share holds
only some of their contexts."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from engine_utils import wait_no_holds

from radixrt.frontend import EngineBackend, function, gen
from radixrt.frontend.admission import BatchAdmission
from radixrt.frontend.backends.base import GenResult
from radixrt.stats import CachePressure


class Pressure:
    """A backend stand-in: `cache_pressure()` is what the test last set."""

    def __init__(self) -> None:
        self.now = self.set(held_blocks=0, held=())

    def set(self, held_blocks: int, held) -> CachePressure:
        self.now = CachePressure(
            num_blocks=20,
            block_size=16,
            free_blocks=20 - held_blocks,
            evictable_blocks=0,
            held_blocks=held_blocks,
            max_held_blocks=10,
            holds_refused=0,
            held=frozenset(held),
        )
        return self.now

    def cache_pressure(self) -> CachePressure:
        return self.now


def result(rid: str, tokens: int) -> GenResult:
    return GenResult("", [], "length", tokens, 0, 0, rid=rid)


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_program_whose_hold_was_refused_waits_for_a_holding_program_to_end():
    backend = Pressure()
    adm = BatchAdmission(backend)
    old, young = adm.program(0), adm.program(1)
    old.start(), young.start()  # nothing known yet: both start
    backend.set(held_blocks=8, held={"a0"})  # the old one's context held, the young one's not
    old.after_call(None, result("a0", 128), 128)
    young.after_call(None, result("b0", 64), 64)
    went = threading.Event()
    t = in_thread(lambda: (young.before_call([("b0", 64)], 96), went.set()))
    assert not went.wait(0.2)  # 6 blocks do not fit the 2 left while the old one runs
    backend.set(held_blocks=0, held=())
    old.end()
    assert went.wait(5)
    t.join()
    assert adm.waits == 1


def test_the_gate_never_stalls_a_batch():
    """No other program holding a context runs: a program goes even without room; a held
    program goes on while its hold and the older ones' fit; a call without an earlier held
    call (a program's first) never waits."""
    backend = Pressure()
    adm = BatchAdmission(backend)
    a, b = adm.program(0), adm.program(1)
    a.start(), b.start()
    backend.set(held_blocks=10, held={"x"})  # another client's holds fill the share
    a.after_call(None, result("a0", 64), 64)
    b.after_call(None, result("b0", 64), 64)
    assert b.before_call([], 500) is None
    done = threading.Event()
    in_thread(lambda: (a.before_call([("a0", 64)], 96), done.set()))
    assert done.wait(5)  # b holds nothing: a's waiting would gain nothing
    backend.set(held_blocks=4, held={"a1"})
    a.after_call(None, result("a1", 64), 64)
    assert a.before_call([("a1", 64)], 96) is not None  # held, 4 + 2 blocks fit in 10
    assert adm.waits == 0


def test_a_younger_held_program_waits_when_the_older_ones_next_calls_fill_the_share():
    backend = Pressure()
    adm = BatchAdmission(backend)
    old, young = adm.program(0), adm.program(1)
    old.start(), young.start()
    backend.set(held_blocks=4, held={"a0"})
    old.after_call(None, result("a0", 64), 64)  # 4 blocks, the first held: older
    backend.set(held_blocks=6, held={"a0", "b0"})
    young.after_call(None, result("b0", 32), 32)
    backend.set(held_blocks=8, held={"a1", "b0"})
    old.after_call(None, result("a1", 128), 128)  # 8 blocks, grew by 4
    went = threading.Event()
    in_thread(lambda: (young.before_call([("b0", 32)], 64), went.set()))
    # the old one's next hold (8 + 4) leaves no room for the young one's 2 + 2
    assert not went.wait(0.2)
    backend.set(held_blocks=2, held={"b0"})
    old.end()
    assert went.wait(5)


def test_new_programs_start_after_the_waiting_ones_go_on():
    backend = Pressure()
    adm = BatchAdmission(backend)
    a, b = adm.program(0), adm.program(1)
    a.start(), b.start()
    backend.set(held_blocks=9, held={"a0"})
    a.after_call(None, result("a0", 144), 144)  # the first hold: 9 blocks
    b.after_call(None, result("b0", 64), 64)
    order = []
    in_thread(lambda: (b.before_call([("b0", 64)], 96), order.append("b")))
    time.sleep(0.05)
    c = adm.program(2)
    in_thread(lambda: (c.start(), order.append("c")))
    time.sleep(0.2)
    assert order == []  # neither fits while a runs
    backend.set(held_blocks=0, held=())
    a.end()
    deadline = time.monotonic() + 5
    while len(order) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == ["b", "c"]


def test_a_branch_counts_its_forks_prefix_hint_as_its_held_context():
    """A fork's prefix hint goes out alongside the branches; its hold, once taken, replaces
    the parent's (the engine's lineages). A branch's call counts the hint's hold as its
    context, in flight or back: it adds only its own blocks and goes on as held, rather than
    waiting as a program whose hold was lost while another program holds a context."""
    backend = Pressure()
    adm = BatchAdmission(backend)
    a, b = adm.program(0), adm.program(1)
    a.start(), b.start()
    backend.set(held_blocks=4, held={"a0"})
    a.after_call(None, result("a0", 64), 64)  # a's context: 4 blocks, the older lineage
    backend.set(held_blocks=7, held={"a0", "b0"})
    b.after_call(None, result("b0", 48), 48)
    hint: Future = Future()  # a's fork hint: the 96-token prefix, in flight
    branch = [("a0", 64), (hint, 96)]

    def goes(calls) -> bool:
        went = threading.Event()
        in_thread(lambda: (a.before_call(calls, 112), went.set()))
        return went.wait(0.3)

    assert goes(branch)  # in flight: the branch adds 1 block to a hold that fits
    hint.set_result(result("h", 96))
    backend.set(held_blocks=9, held={"h", "b0"})  # the hint's hold replaced a0's
    assert goes(branch)
    assert adm.waits == 0
    assert not goes([("a0", 64)])  # as a0's alone: lost, 7 blocks to add, 1 block of room
    backend.set(held_blocks=0, held=())
    b.end()


CHAT_TURN = " The user asks about the weather and the assistant answers it." * 2


@function
def chain(s, i: int):
    s += f"Conversation {i}:"
    for turn in range(4):
        s += f" Turn {turn}." + CHAT_TURN + gen(f"a{turn}", max_tokens=6, temperature=0)


def test_run_batch_admission_keeps_outputs_and_releases_every_hold(make_engine, batch_admissions):
    """8 chains whose contexts need twice the held share: with admission some wait for the
    held ones to end; greedy outputs equal runs one at a time and no hold is left."""
    gates = batch_admissions
    engine = make_engine(num_kv_blocks=96, block_size=16, retention_max_share=0.5)
    backend = EngineBackend(engine)
    try:
        batch = [{"i": i} for i in range(8)]
        states = chain.run_batch(batch, backend=backend)
        wait_no_holds(engine.core.scheduler.retention)
        assert gates and gates[0].waits > 0
        assert not gates[0]._reserved and not gates[0]._waiters
        off = chain.run_batch(batch, backend=backend, admission=False)
        for kw, state, plain in zip(batch, states, off):
            alone = chain.run(backend=backend, **kw)
            assert state.text() == alone.text() == plain.text()
        assert len(gates) == 1  # admission=False makes none
    finally:
        backend.close()
    engine.check_integrity()
