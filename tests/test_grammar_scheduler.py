"""The scheduler's structured-output logic on plain Python: a fake grammar backend (allowed
token sets per output position) and a scripted runner that honours the plan's masks."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import pytest

sys.path.insert(0, "tests")
from grammar_helpers import row_bitmasks  # noqa: E402
from test_step_plan import EOS, make_core  # noqa: E402

from radixrt.deltas import FinishReason  # noqa: E402
from radixrt.grammar.base import CompileOutcome, GrammarStats  # noqa: E402
from radixrt.plan import PlanRow, StepPlan, TokenBitmasks  # noqa: E402
from radixrt.sampling import SamplingParams  # noqa: E402
from radixrt.scheduler.request import RequestStatus  # noqa: E402

VOCAB = 2048
# per output position, the allowed tokens: 3 forced positions (20, 21, EOS) after choices
GRAMMAR = json.dumps([[10, 11, 12], [20], [21], [30, 31], [40, 41], [42], [EOS]])


def pack(allowed: list[int]) -> bytes:
    bits = 0
    for t in allowed:
        bits |= 1 << t
    return bits.to_bytes(VOCAB // 8, "little")


def unpack(mask: bytes) -> list[int]:
    bits = int.from_bytes(mask, "little")
    return [t for t in range(VOCAB) if bits >> t & 1]


@dataclass
class FakeMatcher:
    sets: list[list[int]]
    num_accepted: int = 0

    def accept(self, token: int) -> bool:
        if self.num_accepted >= len(self.sets) or token not in self.sets[self.num_accepted]:
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens <= self.num_accepted
        self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        return self.num_accepted == len(self.sets)

    def next_mask(self) -> bytes:
        return pack(self.sets[self.num_accepted])

    def forced_token(self) -> int | None:
        allowed = self.sets[self.num_accepted]
        return allowed[0] if len(allowed) == 1 else None


class FakeBackend:
    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.submitted: list[str] = []

    def submit(self, spec):
        self.submitted.append(spec.text)
        return spec.text

    def poll(self, ticket):
        if ticket == "bad":
            return CompileOutcome(error="invalid grammar: bad")
        if ticket == "boom":
            return CompileOutcome(error="internal error: boom", internal=True)
        if ticket not in self.ready:
            return None
        return CompileOutcome(grammar=json.loads(ticket))

    def new_matcher(self, grammar):
        return FakeMatcher(grammar)

    def wait(self, tickets, timeout_s):
        pass

    def fill_masks(self, matchers):
        pass

    def close(self):
        pass

    def start(self):
        pass

    def stats(self):
        return GrammarStats()

    def check_integrity(self):
        pass


class MaskingRunner:
    """The scripted runner, with each masked row's sample moved into its allowed set."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.plans: list[StepPlan] = []

    def swap_stats(self):
        return self.inner.swap_stats()

    def check_health(self) -> None:
        pass

    def close(self) -> None:
        pass

    def execute(self, plan: StepPlan):
        self.plans.append(plan)
        handle = self.inner.execute(plan)
        result = handle.result()
        for i, row in enumerate(plan.rows):
            if row_bitmasks(plan, i) is not None and result.tokens[i]:
                allowed = unpack(row_bitmasks(plan, i))
                (token,) = result.tokens[i]
                result.tokens[i] = [allowed[token % len(allowed)]]
                self.inner.last_sample[row.slot] = result.tokens[i][0]
        return handle


def make(overlap: bool, jump_forward: bool = True, **kw):
    core, scripted = make_core(overlap=overlap, **kw)
    runner = MaskingRunner(scripted)
    core.runner = runner
    backend = FakeBackend()
    core.scheduler.use_grammar_backend(backend, jump_forward=jump_forward)
    return core, runner, backend


def drive(core, adds):
    out, done = {}, {}
    for prompt, params, rid in adds:
        core.add_request(prompt, params, rid=rid)
        out[rid] = []
    while core.has_work:
        for d in core.step():
            out.setdefault(d.rid, [])
            out[d.rid] += d.new_token_ids
            if d.finished:
                done[d.rid] = (d.finish_reason, d.error, d.invalid_request)
    core.check_integrity()
    return out, done


CONSTRAINED = SamplingParams(max_tokens=20, grammar=GRAMMAR)
FREE = SamplingParams(max_tokens=6, ignore_eos=True)
ADDS = [
    ([100, 101, 102, 103, 104], CONSTRAINED, "c0"),
    ([100, 101, 102, 200], FREE, "f0"),
    ([100, 101, 102, 103, 300, 301], CONSTRAINED, "c1"),
    ([100, 101, 102, 103, 400], SamplingParams(n=3, max_tokens=20, grammar=GRAMMAR), "c2"),
]


def check_follows(tokens: list[int]) -> None:
    sets = json.loads(GRAMMAR)
    assert len(tokens) == len(sets) and all(t in s for t, s in zip(tokens, sets)), tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_jump_forward_same_outputs_fewer_steps_and_prefilled_runs(overlap):
    results = {}
    for jf in (False, True):
        core, runner, backend = make(overlap, jump_forward=jf)
        backend.ready.add(GRAMMAR)
        out, done = drive(core, ADDS)
        for rid in ("c0", "c1", "c2#0", "c2#1", "c2#2"):
            check_follows(out[rid])
            assert done[rid][0] is FinishReason.STOP
        assert len(out["f0"]) == 6
        for plan in runner.plans:
            for i, row in enumerate(plan.rows):
                if row.rid.startswith("c") and row.sample_offsets:
                    assert row_bitmasks(plan, i) is not None and row.waits_for_result
                    assert not row.reads_last_sample and not row.num_draft_tokens
        stats = core.stats()
        results[jf] = (out, stats["steps"], stats["grammar_forced_tokens"], runner.plans)
    assert results[True][0] == results[False][0]
    assert results[False][2] == 0
    # c0 and c1 are forced from position 1 (20, 21), 5 (42) and 6 (EOS); c2's children too
    assert results[True][2] == 5 * 4
    assert results[True][1] < results[False][1]
    # a forced run after a sample is fed as one extend row: (sampled, 20, 21) in one step
    c0_rows = [r for p in results[True][3] for r in p.rows if r.rid == "c0"]
    assert any(r.num_tokens == 3 and r.input_ids[1:] == [20, 21] for r in c0_rows)


def test_grammar_pending_request_waits_alone():
    core, runner, backend = make(overlap=False)
    core.add_request([100, 101, 102, 103, 104], CONSTRAINED, rid="c0")
    core.add_request([100, 101, 102, 200], FREE, rid="f0")
    finished = []
    for _ in range(10):
        finished += [d.rid for d in core.step() if d.finished]
    c0 = core.request("c0")
    assert finished == ["f0"] and c0.status is RequestStatus.WAITING and not c0.block_table
    grammar = core.scheduler.grammar
    assert grammar.compiling(c0) and grammar.matcher(c0) is None
    backend.ready.add(GRAMMAR)
    out, done = drive(core, [])
    check_follows(out["c0"])
    assert backend.submitted == [GRAMMAR]


def test_idle_step_waits_on_the_compile_instead_of_spinning():
    """A step that plans nothing while a grammar compiles blocks in the backend's `wait`
    (with the pending tickets) instead of returning at once; a step that ran rows never
    waits."""
    core, runner, backend = make(overlap=True)
    waits = []
    backend.wait = lambda tickets, timeout_s: waits.append((list(tickets), timeout_s))
    core.add_request([100, 101, 102, 200], FREE, rid="f0")
    core.add_request([100, 101, 102, 103, 104], CONSTRAINED, rid="c0")
    finished = []
    while "f0" not in finished:
        finished += [d.rid for d in core.step() if d.finished]
    assert waits == []  # f0's steps ran: no waiting while there was work
    core.step()
    core.step()
    assert [w[0] for w in waits] == [[GRAMMAR], [GRAMMAR]] and all(0 < w[1] < 1 for w in waits)
    backend.ready.add(GRAMMAR)
    out, done = drive(core, [])
    check_follows(out["c0"])
    assert len(waits) == 2  # compiled: the loop runs c0's rows without waiting


@pytest.mark.parametrize("n", [1, 2])
def test_compile_error_fails_that_request_with_invalid_request(n):
    core, runner, backend = make(overlap=True)
    out, done = drive(
        core,
        [
            ([100, 101, 102], SamplingParams(n=n, grammar="bad"), "bad"),
            ([100, 101, 102, 200], FREE, "f0"),
        ],
    )
    rids = ["bad"] if n == 1 else ["bad#0", "bad#1"]
    for rid in rids:
        assert done[rid] == (FinishReason.ERROR, "invalid grammar: bad", True)
        assert out[rid] == []
    assert done["f0"][0] is FinishReason.LENGTH
    assert core.stats()["grammar_errors"] == 1 and core.stats()["failed_requests"] == 0


@pytest.mark.parametrize("jump_forward", [False, True])
def test_grammar_that_allows_nothing_after_a_token_fails_as_invalid(jump_forward):
    """A grammar whose language is empty past its first token (the mask after it is all
    zero) stops the request as the request's fault, instead of sampling from nothing."""
    core, runner, backend = make(overlap=False, jump_forward=jump_forward)
    dead = json.dumps([[5, 6], [], [7]])
    backend.ready.add(dead)
    params = SamplingParams(max_tokens=10, grammar=dead)
    out, done = drive(core, [([100, 101, 102], params, "d"), ([100, 101, 102, 200], FREE, "f")])
    reason, error, invalid = done["d"]
    assert (reason, invalid) == (FinishReason.ERROR, True) and out["d"] in ([5], [6])
    assert error.startswith("invalid grammar: no output can match it"), error
    assert done["f"][0] is FinishReason.LENGTH
    assert core.stats()["grammar_errors"] == 1 and core.stats()["failed_requests"] == 0


def test_engine_fault_while_compiling_is_not_the_requests_fault():
    core, runner, backend = make(overlap=False)
    out, done = drive(core, [([100, 101, 102], SamplingParams(grammar="boom"), "x")])
    assert done["x"] == (FinishReason.ERROR, "internal error: boom", False)
    assert core.stats()["failed_requests"] == 1 and core.stats()["grammar_errors"] == 0


def test_constrained_request_without_backend_is_refused():
    core, runner, backend = make(overlap=False)
    core.scheduler.use_grammar_backend(None)
    with pytest.raises(ValueError, match="grammar backend"):
        core.add_request([1, 2], CONSTRAINED)


def test_preemption_keeps_matcher_and_tokens_in_step():
    core, runner, backend = make(overlap=True, num_kv_blocks=8)
    backend.ready.add(GRAMMAR)
    adds = [([100 + i, 101, 102, 103, 104, 105], CONSTRAINED, f"c{i}") for i in range(4)]
    out, done = drive(core, adds)
    for i in range(4):
        check_follows(out[f"c{i}"])
    assert core.stats()["preemptions"] > 0


def test_plan_codec_carries_the_bitmask():
    from radixrt.executor.tp.plan_codec import PlanDecoder, PlanEncoder

    mask = pack([5, 77, 2047])
    rows = [
        PlanRow("", 0, 0, 2, [1, 2], sample_offsets=[1]),
        PlanRow("", 1, 4, 1, [3], sample_offsets=[0]),
    ]
    sent = StepPlan(0, rows, bitmasks=TokenBitmasks([1], mask))
    _, plan = PlanDecoder().decode(PlanEncoder().encode(sent))
    assert plan == sent and row_bitmasks(plan, 1) == mask and row_bitmasks(plan, 0) is None


def test_scheduler_grammar_path_and_front_import_no_torch_or_xgrammar():
    from test_step_plan import run_blocked

    run_blocked(
        ["torch", "numpy", "xgrammar"],
        """
        import radixrt.grammar, radixrt.scheduler.grammar, radixrt.grammar.api
        import radixrt.server.validate
        sys.path.insert(0, "tests")
        import test_grammar_scheduler as t
        t.test_jump_forward_same_outputs_fewer_steps_and_prefilled_runs(True)
        """,
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_jump_forward_fails_that_request_only(overlap):
    """Jump-forward raising for one request (or one n > 1 child) while a result is applied
    fails it (its group) with ERROR, counted, nothing held; the others finish as usual."""
    core, _, backend = make(overlap)
    backend.ready.add(GRAMMAR)
    original = core.scheduler.grammar._jump_forward

    def broken(req):
        if req.rid in ("c1", "c2#1"):
            raise KeyError("injected")
        return original(req)

    core.scheduler.grammar._jump_forward = broken
    out, done = drive(core, ADDS)
    for rid in ("c1", "c2#0", "c2#1", "c2#2"):
        assert done[rid][0] is FinishReason.ERROR and "injected" in done[rid][1], rid
    check_follows(out["c0"])
    assert done["c0"][0] is FinishReason.STOP and len(out["f0"]) == 6
    assert core.stats()["failed_requests"] == 1 + 3
