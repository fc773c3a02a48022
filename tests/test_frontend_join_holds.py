"""Joined branches' held contexts: kept until the parent state's next call, which keeps the one
its context extends (a verdict written after the first branch's judgement) and releases the
rest before it goes out; a fork or the program's end releases them all. A recording backend
(no model) shows when each hold ends relative to the calls."""

from __future__ import annotations

import itertools
import threading

from radixrt.frontend import Backend, GenResult, function, gen


class Tok:
    bos_token = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class Recorder(Backend):
    """Each gen answers "x" and records ("gen", rid, prompt); releases are recorded as
    ("release", rid), in order with the gens."""

    tokenizer = Tok()
    releases_holds = True
    holds_back_shared_prefixes = True  # a fork's hint goes out beside the branches

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._rids = itertools.count()
        self._lock = threading.Lock()

    def generate(self, prompt_ids, params, on_delta=None, options=None) -> GenResult:
        with self._lock:
            rid = f"r{next(self._rids)}"
            if params.max_tokens:
                self.events.append(("gen", rid, "".join(map(chr, prompt_ids))))
        text = "x" if params.max_tokens else ""
        return GenResult(
            text, [1] if text else [], "length", len(prompt_ids), len(text), 0, rid=rid
        )

    def score_continuations(self, prefix_ids, continuations, cache_salt=None):
        raise AssertionError("no select in these programs")

    def release_cache_holds(self, rids):
        with self._lock:
            self.events += [("release", rid) for rid in rids]

    def gen_rid(self, prompt_end: str) -> str:
        (rid,) = [e[1] for e in self.events if e[0] == "gen" and e[2].endswith(prompt_end)]
        return rid

    def position(self, event: tuple) -> int:
        return self.events.index(event)


@function
def verdict(s, extends_a_branch: bool = True):
    s += "Head."
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f" Criterion {i}:" + gen("j", max_tokens=1)
    forks.join()
    if extends_a_branch:
        for i, text in enumerate(forks["j"]):
            s += f" Criterion {i}:" + text
    else:
        s += " Something else."
    s += " Verdict:" + gen("v", max_tokens=1)


def test_the_verdict_keeps_the_branch_it_extends_and_releases_the_others_first():
    backend = Recorder()
    verdict.run(backend=backend)
    first, second, third = (backend.gen_rid(f"Criterion {i}:") for i in range(3))
    v = backend.position(("gen", backend.gen_rid("Verdict:"), _prompt(backend, "Verdict:")))
    released = {e[1]: backend.position(e) for e in backend.events if e[0] == "release"}
    assert released[second] < v and released[third] < v  # given back before the verdict
    assert released[first] > v  # held across it, released with the program's holds
    assert set(released) >= {first, second, third}  # nothing left held


def test_a_call_that_extends_no_branch_releases_them_all_first():
    backend = Recorder()
    verdict.run(extends_a_branch=False, backend=backend)
    v = backend.position(("gen", backend.gen_rid("Verdict:"), _prompt(backend, "Verdict:")))
    for i in range(3):
        rid = backend.gen_rid(f"Criterion {i}:")
        assert backend.position(("release", rid)) < v


@function
def agent(s, calls: int):
    s += "Identity."
    for i in range(calls):
        branch = s.fork(1)
        branch[0] += f" Question {i}:" + gen("a", max_tokens=1)
        branch.join()


def test_joined_holds_do_not_pile_up_when_the_parent_only_forks_again():
    """Generative agents: each call forks from the identity and the parent never calls. The
    previous branch's hold ends at the next fork, before that branch's call."""
    backend = Recorder()
    agent.run(calls=3, backend=backend)
    rids = [backend.gen_rid(f"Question {i}:") for i in range(3)]
    for earlier, later in zip(rids, rids[1:]):
        later_gen = next(e for e in backend.events if e[0] == "gen" and e[1] == later)
        assert backend.position(("release", earlier)) < backend.position(later_gen)
    assert backend.position(("release", rids[-1])) > 0  # the last one at the program's end


def _prompt(backend: Recorder, end: str) -> str:
    (prompt,) = [e[2] for e in backend.events if e[0] == "gen" and e[2].endswith(end)]
    return prompt


@function
def judged(s, i: int):
    s += f"Answer {i} is to be judged." + " The criteria follow." * 4
    forks = s.fork(3)
    for c, f in enumerate(forks):
        f += f" Criterion {c}:" + gen("j", max_tokens=4, temperature=0)
    forks.join()
    for c, text in enumerate(forks["j"]):
        s += f" Criterion {c}:" + text
    s += " Verdict:" + gen("v", max_tokens=4, temperature=0)


def test_judged_batches_on_an_engine_release_every_hold(make_engine):
    """On an engine (holds, lineages, admission): the joined contexts handed to the verdict are
    released with the program; outputs equal runs one at a time."""
    from engine_utils import wait_no_holds

    from radixrt.frontend import EngineBackend

    engine = make_engine(num_kv_blocks=128, block_size=16, retention_max_share=0.5)
    backend = EngineBackend(engine)
    try:
        batch = [{"i": i} for i in range(6)]
        states = judged.run_batch(batch, backend=backend)
        wait_no_holds(engine.core.scheduler.retention)
        for kw, state in zip(batch, states):
            assert state.text() == judged.run(backend=backend, **kw).text()
    finally:
        backend.close()
    engine.check_integrity()
