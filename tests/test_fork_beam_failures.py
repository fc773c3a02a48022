"""Failure isolation inside groups (n > 1, beam search) on the scripted runner: an exception
while planning or applying one member's row fails its whole group cleanly (every reporting
member gets an ERROR delta, nothing leaks) and never another request; and the fork / beam
memory counters count what they say."""

from __future__ import annotations

import pytest
from test_fork_beam_scheduler import (
    beam_tops,
    content_core,
    ctx_token,
    drive,
    expect,
    reference_beams,
)

from radixrt.deltas import FinishReason
from radixrt.sampling import BeamSearchParams, SamplingParams
from radixrt.scheduler.request import fork_rid

PLAIN = list(range(60, 70))
PROMPT = list(range(100, 111))


def _breaks(core, method: str, bad_rid: str, after: int = 0) -> list[int]:
    """Make scheduler part `method` ("part.name", e.g. "rows.plan_row", or a longer path),
    called as `method(req, ...)`, raise for `bad_rid` from its `after`-th call on."""
    *path, name = method.split(".")
    owner = core.scheduler
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = [0]

    def broken(req, *args, **kw):
        if req.rid == bad_rid:
            calls[0] += 1
            if calls[0] > after:
                raise KeyError("injected")
        return original(req, *args, **kw)

    setattr(owner, name, broken)
    return calls


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "method, bad, after",
    [
        ("lifecycle.stop_reason", fork_rid("p", 1), 2),  # applying a child's token
        ("rows.plan_row", fork_rid("p", 2), 1),  # planning a child's decode row
        ("results.apply_row", "p", 0),  # applying the parent's prefill
        ("rows.plan_row", "p", 0),  # planning the parent's prefill
    ],
)
def test_a_failing_child_fails_its_group_only(overlap, method, bad, after):
    core, _ = content_core(overlap=overlap)
    core.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, n=3), rid="p")
    core.add_request(PLAIN, SamplingParams(max_tokens=9, ignore_eos=True), rid="x")
    calls = _breaks(core, method, bad, after)
    done = drive(core)  # integrity after every step
    assert calls[0] > after
    for c in range(3):
        d = done[fork_rid("p", c)][2]
        assert d.finish_reason is FinishReason.ERROR and "injected" in d.error
        assert d.parent_rid == "p" and d.index == c
    assert done["x"][0] == expect("x", PLAIN, 9)
    assert done["x"][1] is FinishReason.LENGTH
    assert core.stats()["failed_requests"] == 3
    assert not core.scheduler.requests


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("method, after", [("results.apply_row", 3), ("rows.plan_row", 2)])
def test_a_failing_beam_fails_its_search_only(overlap, method, after):
    core, runner = content_core(overlap=overlap)
    runner.context_fn = lambda rid, ctx: beam_tops(ctx) if "#" in rid else ctx_token(rid, ctx)
    core.add_beam_search(PROMPT[:7], BeamSearchParams(beam_width=3, max_tokens=9), "b")
    core.add_request(PLAIN, SamplingParams(max_tokens=9, ignore_eos=True), rid="x")
    calls = _breaks(core, method, fork_rid("b", 0), after)
    done = drive(core)
    assert calls[0] > after
    d = done["b"][2]
    assert d.finish_reason is FinishReason.ERROR and "injected" in d.error and d.beams == []
    assert done["x"][0] == expect("x", PLAIN, 9)
    assert not core.scheduler.requests


def test_fork_counters_count_shared_and_copied_blocks():
    """forks / fork_shared_blocks / fork_copied_blocks per fork: an 11-token prompt with
    block size 4 forks after 10 tokens (2 full blocks + 2 tokens): each of the n - 1 new
    children references the 2 full blocks and gets 1 copied block (child 0 takes over)."""
    core, _ = content_core(overlap=False, prefix_cache="none", block_size=4)
    core.add_request(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True, n=4), rid="p")
    core.add_request(PROMPT[:9], SamplingParams(max_tokens=4, ignore_eos=True, n=2), rid="q")
    drive(core)
    s = core.stats()
    # q: 8 tokens computed by the parent = 2 full blocks, nothing partial: no copy
    assert s["forks"] == 2
    assert s["fork_shared_blocks"] == 2 * 3 + 2 * 1
    assert s["fork_copied_blocks"] == 3 + 0
    assert s["beam_steps"] == 0


def test_beam_counters_count_steps_and_blocks():
    """beam_steps is one per generated token of the search; every re-parented beam (a pick
    that is not its source's first) references the source's full blocks and copies its
    partial one (shared + copied == what the re-parentings imply)."""
    core, runner = content_core(overlap=False, prefix_cache="none", block_size=4)
    runner.context_fn = lambda rid, ctx: beam_tops(ctx)
    sched = core.scheduler
    reparented = []
    original = sched.kv.share_prefix

    def share(src, dst, copy, ops):
        reparented.append((src.num_computed // 4, src.num_computed % 4 > 0))
        return original(src, dst, copy, ops)

    sched.kv.share_prefix = share
    core.add_beam_search([7, 8, 9], BeamSearchParams(beam_width=3, max_tokens=6), "b")
    done = drive(core)
    s = core.stats()
    out = done["b"][2]
    assert s["beam_steps"] == max(len(h.output_token_ids) for h in out.beams)
    assert reparented and s["forks"] == 1 and s["fork_shared_blocks"] == 0  # 1 first beam
    assert s["beam_copied_blocks"] == sum(partial for _, partial in reparented)
    assert s["beam_shared_blocks"] == sum(full for full, _ in reparented)


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_only_children_finish(overlap):
    """n > 1 with max_tokens = 0 (prompt scoring, cache warming): each child feeds the last
    prompt token and finishes with nothing (it is not mistaken for a fork parent)."""
    core, _ = content_core(overlap=overlap)
    core.add_request([5, 6, 7], SamplingParams(max_tokens=0, n=2), rid="p")
    core.add_request([5], SamplingParams(max_tokens=0, n=3), rid="q")
    done = drive(core)
    rids = [fork_rid("p", c) for c in range(2)] + [fork_rid("q", c) for c in range(3)]
    assert {rid: (v[0], v[1]) for rid, v in done.items()} == {
        rid: ([], FinishReason.LENGTH) for rid in rids
    }


# ---- one request's failure stays its own ----
def _break_beam_scorer(core, rid: str, after: int) -> list[int]:
    """Make the beam search `rid`'s selection step (its scoring) raise from its `after`-th
    call on: scheduler-side arithmetic on one request's parameters that fails."""
    state = core.scheduler.requests[rid].group.beam
    original, calls = state.step, [0]

    def broken(outputs, top_logprobs):
        calls[0] += 1
        if calls[0] > after:
            raise OverflowError("injected: length ** length_penalty")
        return original(outputs, top_logprobs)

    state.step = broken
    return calls


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("after", [0, 3])
def test_a_failing_beam_scorer_fails_its_search_only(overlap, after):
    """The selection step raising (before the fix: OverflowError / ZeroDivisionError of an
    extreme length_penalty) used to escape `update` and stop the engine loop; now that
    search ends with ERROR, its KV is freed, the failure is counted once, and another search
    and a plain request in the same batches finish with their reference results."""
    core, runner = content_core(overlap=overlap)
    runner.context_fn = lambda rid, ctx: beam_tops(ctx) if "#" in rid else ctx_token(rid, ctx)
    good = BeamSearchParams(beam_width=2, max_tokens=6)
    core.add_beam_search(PROMPT[:7], BeamSearchParams(beam_width=3, max_tokens=9), "bad")
    core.add_beam_search(PROMPT[2:9], good, "good")
    core.add_request(PLAIN, SamplingParams(max_tokens=9, ignore_eos=True), rid="x")
    calls = _break_beam_scorer(core, "bad", after)
    done = drive(core)  # integrity after every step
    assert calls[0] == after + 1
    d = done["bad"][2]
    assert d.finish_reason is FinishReason.ERROR and "injected" in d.error and d.beams == []
    want = reference_beams(PROMPT[2:9], good)
    assert [h.output_token_ids for h in done["good"][2].beams] == [h.output_token_ids for h in want]
    assert done["x"][0] == expect("x", PLAIN, 9)
    assert core.stats()["failed_requests"] == 1  # the search; its beams are not requests
    assert not core.scheduler.requests


class NoDrafts:
    """A drafter of nothing (`radixrt.scheduler.rows.Drafter`), for an engine without
    speculation."""

    def drafts(self, req, spare):
        return []

    def choose(self, proposals, num_rows, spare):
        return dict(proposals)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("method, after", [("admission._try_start", 0), ("rows.drafter.drafts", 2)])
def test_a_failing_admission_or_draft_fails_that_request_only(overlap, method, after):
    """Starting a request (match, lock, blocks) or drafting for it raising fails it alone
    (ERROR, counted, nothing held), in the step that planned it; the others run on."""
    core, _ = content_core(overlap=overlap)
    core.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), rid="bad")
    core.add_request(PLAIN, SamplingParams(max_tokens=9, ignore_eos=True), rid="x")
    core.add_request(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, n=2), rid="p")
    if method.startswith("rows.drafter"):
        core.scheduler.rows.drafter = NoDrafts()
    calls = _breaks(core, method, "bad", after)
    done = drive(core)
    assert calls[0] > after
    assert done["bad"][1] is FinishReason.ERROR and "injected" in done["bad"][2].error
    assert done["x"][0] == expect("x", PLAIN, 9)
    for c in range(2):
        assert done[fork_rid("p", c)][1] is FinishReason.LENGTH
    assert core.stats()["failed_requests"] == 1


def test_a_failing_group_start_fails_the_group_only():
    core, runner = content_core(overlap=False)
    runner.context_fn = lambda rid, ctx: beam_tops(ctx) if "#" in rid else ctx_token(rid, ctx)
    core.add_beam_search(PROMPT[:7], BeamSearchParams(beam_width=3, max_tokens=5), "b")
    core.add_request(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, n=3), rid="p")
    core.add_request(PLAIN, SamplingParams(max_tokens=9, ignore_eos=True), rid="x")
    _breaks(core, "admission._try_start", "b")
    _breaks(core, "admission._try_start", "p")
    done = drive(core)
    assert done["b"][1] is FinishReason.ERROR and done["b"][2].beams == []
    assert all(done[fork_rid("p", c)][1] is FinishReason.ERROR for c in range(3))
    assert done["x"][0] == expect("x", PLAIN, 9)
    assert core.stats()["failed_requests"] == 1 + 3


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "bad, after", [("bad", 1), ("bad", 0), (fork_rid("p", 1), 1), ("b", 0)], ids=str
)
def test_a_failing_delta_fails_that_request_only(overlap, bad, after):
    """Making one request's delta raising (the last stage of a step) fails it (an n > 1
    child: its siblings too; a finished beam search: its one delta) with an ERROR delta,
    counted, nothing held, no delta bookkeeping left; the others stream on."""
    core, runner = content_core(overlap=overlap)
    runner.context_fn = lambda rid, ctx: beam_tops(ctx) if "#" in rid else ctx_token(rid, ctx)
    core.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), rid="bad")
    core.add_request(PLAIN, SamplingParams(max_tokens=9, ignore_eos=True), rid="x")
    core.add_request(PROMPT[:9], SamplingParams(max_tokens=6, ignore_eos=True, n=2), rid="p")
    core.add_beam_search(PROMPT[2:9], BeamSearchParams(beam_width=2, max_tokens=5), "b")
    original, calls = core._delta, [0]

    def broken(req):
        if req.rid == bad:
            calls[0] += 1
            if calls[0] > after:
                raise KeyError("injected")
        return original(req)

    core._delta = broken
    done = drive(core)  # integrity (deltas' bookkeeping too) after every step
    failed = {fork_rid("p", 0), fork_rid("p", 1)} if bad == fork_rid("p", 1) else {bad}
    for rid in failed:
        assert done[rid][1] is FinishReason.ERROR, rid
    assert "injected" in done[bad][2].error
    assert done["x"][0] == expect("x", PLAIN, 9)
    others = {"bad", fork_rid("p", 0), fork_rid("p", 1), "b"} - failed
    assert all(done[rid][1] in (FinishReason.LENGTH, FinishReason.STOP) for rid in others)
    assert core.stats()["failed_requests"] == len(failed)
    assert not core.scheduler.requests
