"""A fork's prefix hint on a backend that holds back requests sharing an uncached prefix: the
branches go out while the hint is in flight (elsewhere, and for a select's scoring, after it);
the hint's hold is released at the program's end and its failure is raised at the parent's
next call or sync point. A fake backend (no model) whose hint blocks until a branch releases
it: a fork that waited for its hint times out rather than hangs."""

from __future__ import annotations

import itertools
import threading

import pytest

from radixrt.config import holds_back_shared_prefixes
from radixrt.frontend import Backend, BackendError, EngineBackend, GenResult, function, gen, select
from radixrt.frontend.backends.http import _holds_back_shared_prefixes

TIMEOUT_S = 5.0  # a hint nobody releases fails after this long


class Tok:
    bos_token = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class BlockingHint(Backend):
    """The prefix hint (max_tokens=0) blocks until `release` is set (by a gen or a scoring
    call, or the test); `events` records what was sent, in order."""

    tokenizer = Tok()
    releases_holds = True  # programs hold their contexts and release them at their end

    def __init__(self, holds_back: bool, fail_hint: bool = False) -> None:
        self.holds_back_shared_prefixes = holds_back
        self.fail_hint = fail_hint
        self.release = threading.Event()
        self.hint_back = threading.Event()  # the hint returned (or failed)
        self.events: list[tuple[str, bool]] = []  # (call, whether the hint was back then)
        self.released: list[str] = []
        self.hint_rids: list[str] = []
        self._rids = itertools.count()

    def generate(self, prompt_ids, params, on_delta=None, options=None) -> GenResult:
        rid = f"r{next(self._rids)}"
        if params.max_tokens == 0:
            self.events.append(("hint", self.hint_back.is_set()))
            released = self.release.wait(TIMEOUT_S)
            self.hint_back.set()
            if not released:
                raise TimeoutError("no branch call came while the hint was in flight")
            if self.fail_hint:
                raise BackendError("the prefix hint failed")
            self.hint_rids.append(rid)
            return GenResult("", [], "length", len(prompt_ids), 0, 0, rid=rid)
        self.events.append(("gen", self.hint_back.is_set()))
        self.release.set()
        return GenResult("x", [1], "length", len(prompt_ids), 1, 0, rid=rid)

    def score_continuations(self, prefix_ids, continuations, cache_salt=None):
        self.events.append(("score", self.hint_back.is_set()))
        self.release.set()
        return [[-1.0] * len(c) for c in continuations]

    def release_cache_holds(self, rids):
        self.released += rids


@function
def forked(s, after: bool = False):
    s += "A shared prefix."
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" Branch {i}:" + gen("b", max_tokens=1)
    forks.join()
    if after:
        s += " After:" + gen("a", max_tokens=1)


def test_branches_go_out_while_the_hint_is_in_flight():
    backend = BlockingHint(holds_back=True)
    state = forked.run(backend=backend)
    assert ("hint", False) in backend.events
    gens = [back for call, back in backend.events if call == "gen"]
    assert gens and not gens[0]  # the first branch's gen went out before the hint was back
    assert state.text() == "A shared prefix."
    # the hint's hold ends with the program (the branches' at their join)
    assert backend.hint_rids and set(backend.hint_rids) <= set(backend.released)
    assert len(backend.released) == 3


def test_without_hold_back_branches_wait_for_the_hint():
    backend = BlockingHint(holds_back=False)
    timer = threading.Timer(0.2, backend.release.set)  # nothing else releases the hint
    timer.start()
    try:
        forked.run(backend=backend)
    finally:
        timer.cancel()
    assert backend.events[0] == ("hint", False)
    assert [back for call, back in backend.events[1:]] == [True, True]
    assert set(backend.hint_rids) <= set(backend.released) and len(backend.released) == 3


def test_the_parents_next_call_takes_the_hints_hold_first():
    backend = BlockingHint(holds_back=True)
    state = forked.run(after=True, backend=backend)
    assert state["a"] == "x"
    # released at the end: the parent's holds in order (the hint's before its gen's)
    (hint,) = backend.hint_rids
    parent = [rid for rid in backend.released if rid == hint or rid == "r3"]
    assert parent == [hint, "r3"]


@pytest.mark.parametrize("after", [False, True])
def test_a_failed_hint_raises_at_the_parents_sync_point(after):
    """Raised by the parent's next call (after=True) or at the program's end."""
    backend = BlockingHint(holds_back=True, fail_hint=True)
    with pytest.raises(BackendError, match="the prefix hint failed"):
        forked.run(after=after, backend=backend)
    assert len(backend.released) == 2  # the branches' holds; the hint held nothing

    @function
    def handled(s):
        forked.func(s)
        try:
            s["missing"]  # a sync point: the hint's error, not the unknown variable
        except BackendError:
            s += " handled"

    backend = BlockingHint(holds_back=True, fail_hint=True)
    assert handled.run(backend=backend).text() == "A shared prefix. handled"


def test_a_selects_scoring_waits_for_its_hint_everywhere():
    @function
    def choose(s):
        s += "Pick one:" + select("c", choices=["a", "bb"])

    backend = BlockingHint(holds_back=True)
    timer = threading.Timer(0.2, backend.release.set)  # the scoring does not release it
    timer.start()
    try:
        assert choose.run(backend=backend)["c"] == "a"
    finally:
        timer.cancel()
    assert backend.events == [("hint", False), ("score", True)]
    assert backend.released == backend.hint_rids


def test_which_runtimes_hold_back_shared_prefixes(make_engine):
    assert holds_back_shared_prefixes("lpm", "radix")
    assert holds_back_shared_prefixes("random", "blockhash")
    assert not holds_back_shared_prefixes("fcfs", "radix")
    assert not holds_back_shared_prefixes("lpm", "none")
    # GET /get_server_info without radixrt's fields: an older radixrt, SGLang, a 404
    assert _holds_back_shared_prefixes({"schedule_policy": "lpm", "prefix_cache": "radix"})
    assert not _holds_back_shared_prefixes({"schedule_policy": "lpm", "disable_radix_cache": 0})
    assert not _holds_back_shared_prefixes(None)
    for options, expected in (({}, True), ({"policy": "fcfs"}, False)):
        backend = EngineBackend(make_engine(**options))  # default policy: auto (lpm)
        try:
            assert backend.holds_back_shared_prefixes is expected
        finally:
            backend.close()


@function
def fork_after_gen(s, more: str = ""):
    s += "A shared prefix." + gen("g", max_tokens=1) + more
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" Branch {i}:" + gen("b", max_tokens=1)
    forks.join()


@pytest.mark.parametrize("holds_back", [True, False])
def test_a_fork_right_after_a_gen_sends_no_hint(holds_back):
    backend = BlockingHint(holds_back)
    backend.release.set()  # a hint, if sent, returns at once
    fork_after_gen.run(backend=backend)
    assert [e for e, _ in backend.events] == ["gen", "gen", "gen"]
    backend = BlockingHint(holds_back)
    backend.release.set()
    fork_after_gen.run(backend=backend, more=" and more text")
    assert sorted(e for e, _ in backend.events) == ["gen", "gen", "gen", "hint"]
