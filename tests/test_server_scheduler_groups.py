"""The scheduler process's side of n > 1 and beam search, without processes: `SchedulerLoop`
over an EngineCore with the scripted runner. One TokenizedRequest forks n children whose
RequestDeltas name parent_rid / index; an AbortRequest with `index` ends that child alone (its
siblings go on); a BeamSearchRequest reports once with its beams; refusals are 400s naming
the field; the snapshot carries the fork / beam counters. Integrity after every step."""

from __future__ import annotations

import re

import msgspec
import pytest
from test_fork_beam_scheduler import beam_tops, content_core, ctx_token, expect

from radixrt.errors import RequestValueError
from radixrt.sampling import BeamSearchParams, SamplingParams
from radixrt.scheduler.request import fork_rid
from radixrt.server.messages import (
    AbortRequest,
    BeamSearchRequest,
    FromScheduler,
    SchedulerSnapshot,
    TokenBatchOut,
    TokenizedRequest,
)
from radixrt.server.scheduler_process import SchedulerLoop

PROMPT = list(range(100, 111))


def loop_over(core) -> SchedulerLoop:
    return SchedulerLoop(core, inbox=None, outbox=None, parent_pid=0)


def step(loop: SchedulerLoop, outs: dict, msgs=()) -> None:
    core = loop.core
    errors, finished = loop._handle(list(msgs))
    assert not errors, errors
    deltas = [*finished, *(core.step() if core.has_work else [])]
    # what the front gets: the engine's deltas through the wire as they are
    sent = TokenBatchOut(deltas, [], SchedulerSnapshot(core.stats_struct()))
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=FromScheduler)
    assert got == sent
    for o in got.outputs:
        outs.setdefault((o.parent_rid, o.index, o.rid), []).append(o)
    core.check_integrity()


def test_one_request_forks_and_one_child_is_aborted_alone():
    core, _ = content_core(overlap=True)
    loop = loop_over(core)
    outs: dict = {}
    params = SamplingParams(max_tokens=10, ignore_eos=True, n=3)
    step(loop, outs, [TokenizedRequest("p", PROMPT, params)])
    for _ in range(4):
        step(loop, outs)
    step(loop, outs, [AbortRequest("p", "stop", index=1)])
    while core.has_work:
        step(loop, outs)
    assert set(outs) == {("p", c, fork_rid("p", c)) for c in range(3)}
    tokens = {k[1]: [t for o in v for t in o.new_token_ids] for k, v in outs.items()}
    reasons = {k[1]: v[-1].finish_reason for k, v in outs.items()}
    assert reasons == {0: "length", 1: "stop", 2: "length"}
    for c in (0, 2):
        assert tokens[c] == expect(fork_rid("p", c), PROMPT, 10)
    assert len(tokens[1]) < 10
    snap = loop._snapshot().stats
    assert snap.forks == 1 and snap.fork_shared_blocks == 2 * 2 and snap.fork_copied_blocks == 2
    assert core.allocator.num_free + core.cache.cached_blocks == core.allocator.num_blocks


def test_beam_search_request_reports_its_beams_once():
    core, runner = content_core(overlap=False)
    runner.context_fn = lambda rid, ctx: beam_tops(ctx) if "#" in rid else ctx_token(rid, ctx)
    loop = loop_over(core)
    outs: dict = {}
    step(loop, outs, [BeamSearchRequest("b", PROMPT[:7], BeamSearchParams(3, 6))])
    while core.has_work:
        step(loop, outs)
    ((key, (out,)),) = outs.items()
    assert key == (None, 0, "b") and out.finish_reason in ("stop", "length")
    assert len(out.beams) == 3 and out.new_token_ids == []
    assert [b.score for b in out.beams] == sorted((b.score for b in out.beams), reverse=True)
    for b in out.beams:
        assert b.finish_reason == ("stop" if b.output_token_ids[-1] in core.scheduler.eos_token_ids
                                   else "length")  # fmt: skip
    assert loop._snapshot().stats.beam_steps > 0


def test_refusals_name_the_field_and_queue_nothing():
    core, _ = content_core(overlap=False, num_kv_blocks=8, block_size=4)
    loop = loop_over(core)
    errors, _ = loop._handle(
        [
            TokenizedRequest("p", PROMPT, SamplingParams(max_tokens=20, n=3)),
            BeamSearchRequest("b", PROMPT, BeamSearchParams(4, 20)),
        ]
    )
    assert [(e.rid, e.status, e.param) for e in errors] == [
        ("p", 400, "n"),
        ("b", 400, "beam_width"),
    ]
    assert not core.has_work and not core.scheduler.requests
    core.check_integrity()


def test_refusals_carry_the_typed_field_not_one_parsed_from_the_text():
    """RequestError.param is RequestValueError.field (a message need not start with it); a
    plain ValueError names no field."""

    class Refusing:
        def __init__(self, error: ValueError) -> None:
            self.error = error

        def add_request(self, *args) -> None:
            raise self.error

    typed = RequestValueError("the stop sequence top_k=3 is not allowed", "stop")
    for error, param in [(typed, "stop"), (ValueError("invalid n=3: too many"), None)]:
        loop = loop_over(Refusing(error))
        errors, _ = loop._handle([TokenizedRequest("p", PROMPT, SamplingParams())])
        assert [(e.status, e.message, e.param) for e in errors] == [(400, str(error), param)]


def test_engine_refusals_are_typed():
    """The engine's own checks raise RequestValueError with the field (messages unchanged)."""
    core, _ = content_core(overlap=False, num_kv_blocks=8, block_size=4)
    cases = [
        (SamplingParams(max_tokens=20, n=3), "n", "n=3 sequences of prompt + max_tokens need"),
        (SamplingParams(max_tokens=10**6), "max_tokens", "max_tokens=1000000 does not fit"),
        (SamplingParams(max_tokens=40), "max_tokens", "prompt + max_tokens need"),
        (SamplingParams(logit_bias={5000: 1.0}), "logit_bias", "logit_bias token id 5000"),
    ]
    for params, field, message in cases:
        with pytest.raises(RequestValueError, match=re.escape(message)) as e:
            core.add_request(PROMPT, params, rid="p")
        assert e.value.field == field
    with pytest.raises(RequestValueError, match="beam_width=4 sequences of") as e:
        core.add_beam_search(PROMPT, BeamSearchParams(4, 2), rid="b")
    assert e.value.field == "beam_width"
    for prompt, message in (([], "the prompt is empty"), ([1, 10**6], "token id 1000000")):
        with pytest.raises(RequestValueError, match=message) as e:
            core.add_request(prompt, SamplingParams(), rid="q")
        assert e.value.field == "prompt"
    assert not core.has_work and not core.scheduler.requests
