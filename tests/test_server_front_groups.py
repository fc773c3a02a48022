"""`Front` without processes, n > 1 and beam search: one scheduler request per prompt, outputs
routed to choices by (parent_rid, index), per-choice stop strings abort that child alone,
client gone aborts the parent once, errors fail the right choices, and the limits (KV pool,
running slots, beam candidates, fields beam search does not define) are 400s naming the
field before anything is sent."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_server_front import MODEL, READY, CharTokenizer, FakeChannel, batch, spec

from radixrt.deltas import BeamOut, FinishReason, RequestDelta
from radixrt.server.front import Front
from radixrt.server.messages import (
    AbortRequest,
    BeamSearchRequest,
    RequestError,
    TokenizedRequest,
)
from radixrt.server.metrics import ServerMetrics
from radixrt.server.protocol import ApiError
from radixrt.server.validate import parse_generate


def make_front(**ready) -> Front:
    import msgspec

    front = Front(CharTokenizer(), FakeChannel(), None, ServerMetrics(), "m")
    front._dispatch(msgspec.structs.replace(READY, **ready))
    return front


def child_out(rid: str, index: int, ids: list[int], reason: str | None = None) -> RequestDelta:
    reason_ = reason and FinishReason(reason)
    return RequestDelta(f"{rid}#{index}", ids, reason_, 2, 0, 0, parent_rid=rid, index=index)


def body(**kw) -> bytes:
    return json.dumps({"text": "ab", **kw}).encode()


def test_one_request_per_prompt_and_outputs_by_choice():
    async def main():
        front = make_front()
        gen, _ = spec(body(sampling_params={"n": 3, "max_new_tokens": 4, "seed": 5}))
        g = front.generate(gen)
        (msg,) = front.to_scheduler.sent
        assert isinstance(msg, TokenizedRequest) and msg.params.n == 3 and msg.params.seed == 5
        assert [st.params.seed for st in g.states] == [5, 6, 7]  # choice i: seed + i
        assert [st.index for st in g.states] == [0, 1, 2] and len(front.outputs.states) == 1
        front._dispatch(batch([child_out(msg.rid, 2, [0, 1]), child_out(msg.rid, 0, [2])]))
        front._dispatch(batch([child_out(msg.rid, c, [3], "length") for c in range(3)]))
        states = await g.wait()
        assert [st.output_ids for st in states] == [[2, 3], [3], [0, 1, 3]]
        assert [st.text for st in states] == ["cd", "d", "abd"]
        assert front.outputs.states == {}

    asyncio.run(main())


def test_a_stop_string_aborts_that_child_alone():
    async def main():
        front = make_front()
        gen, _ = spec(body(sampling_params={"n": 2, "max_new_tokens": 8, "stop": "c"}))
        g = front.generate(gen)
        rid = front.to_scheduler.sent[0].rid
        front._dispatch(batch([child_out(rid, 1, [0, 1, 2, 3]), child_out(rid, 0, [0])]))
        assert front.to_scheduler.sent[1:] == [AbortRequest(rid, "stop", index=1)]
        front._dispatch(batch([child_out(rid, 1, [], "stop"), child_out(rid, 0, [1], "length")]))
        a, b = await g.wait()
        assert (a.text, a.finish_reason) == ("ab", "length")
        assert (b.text, b.finish_reason) == ("ab", "stop")

    asyncio.run(main())


def test_client_gone_aborts_each_parent_once_and_errors_fail_choices():
    async def main():
        front = make_front()
        gen, _ = spec(body(text=["ab", "cd"], sampling_params={"n": 3, "max_new_tokens": 4}))
        g = front.generate(gen)
        first, second = (m.rid for m in front.to_scheduler.sent)
        front._dispatch(batch([child_out(first, 0, [1], "length")]))
        async with g:
            pass  # the client left
        assert front.to_scheduler.sent[2:] == [AbortRequest(first), AbortRequest(second)]
        assert front.outputs.states == {}

        g = front.generate(gen, "mine")
        first, second = (m.rid for m in front.to_scheduler.sent[4:])
        assert front.abort_client_rid("mine") == 6
        assert front.to_scheduler.sent[6:] == [AbortRequest(first), AbortRequest(second)]
        # a child's 500 fails that choice; a 400 of the request every choice
        front._dispatch(batch(errors=[RequestError(f"{first}#1", "boom", 500, first, 1)]))
        front._dispatch(batch(errors=[RequestError(second, "bad n", 400, param="n")]))
        assert [st.error is not None for st in g.states] == [False, True, False] + [True] * 3
        assert g.states[3].error.param == "n"
        with pytest.raises(ApiError, match="boom"):
            await g.wait()

    asyncio.run(main())


@pytest.mark.parametrize(
    "sampling, ready, param",
    [
        # 8 blocks of 16: 3 sequences of 2 + 60 tokens need 3 * 4 = 12 blocks
        ({"n": 3, "max_new_tokens": 60}, {}, "sampling_params.n"),
        ({"n": 3, "max_new_tokens": 4}, {"max_running_requests": 2}, "sampling_params.n"),
        ({"beam_width": 3, "max_new_tokens": 60}, {}, "sampling_params.beam_width"),
        ({"beam_width": 7, "max_new_tokens": 4}, {"num_eos_ids": 2}, "sampling_params.beam_width"),
        ({"beam_width": 4, "max_new_tokens": 0}, {}, "sampling_params.max_new_tokens"),
    ],
)
def test_groups_that_can_never_run_are_400_and_nothing_is_sent(sampling, ready, param):
    front = make_front(**ready)
    gen, _ = spec(body(sampling_params=sampling))
    with pytest.raises(ApiError) as e:
        front.generate(gen)
    assert e.value.param == param and e.value.status == 400, e.value.message
    assert front.to_scheduler.sent == [] and front.outputs.states == {}


def test_beam_search_request_and_results():
    async def main():
        front = make_front()
        gen, _ = spec(
            body(sampling_params={"beam_width": 2, "max_new_tokens": 3, "length_penalty": 0.5})
        )
        g = front.generate(gen)
        (msg,) = front.to_scheduler.sent
        assert isinstance(msg, BeamSearchRequest)
        assert (msg.params.beam_width, msg.params.max_tokens, msg.params.length_penalty) == (
            2,
            3,
            0.5,
        )
        stop, length = FinishReason.STOP, FinishReason.LENGTH
        beams = [BeamOut([1, 2], -1.0, -0.7, stop), BeamOut([3, 4, 5], -2.0, -1.1, length)]
        front._dispatch(batch([RequestDelta(msg.rid, [], stop, 2, 0, 0, beams=beams)]))
        (st,) = await g.wait()
        assert [(b.text, b.output_ids, b.score) for b in st.beams] == [
            ("bc", [1, 2], -0.7),
            ("def", [3, 4, 5], -1.1),
        ]
        assert st.finish_reason == "stop" and front.outputs.states == {}

    asyncio.run(main())


BEAM = {"beam_width": 2, "max_new_tokens": 4}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"sampling_params": {**BEAM, "n": 2}}, "sampling_params.n"),
        ({"sampling_params": {**BEAM, "temperature": 0.7}}, "sampling_params.temperature"),
        ({"sampling_params": {**BEAM, "top_p": 0.9}}, "sampling_params.top_p"),
        ({"sampling_params": {**BEAM, "top_k": 5}}, "sampling_params.top_k"),
        ({"sampling_params": {**BEAM, "min_p": 0.1}}, "sampling_params.min_p"),
        ({"sampling_params": {**BEAM, "seed": 1}}, "sampling_params.seed"),
        ({"sampling_params": {**BEAM, "stop": "x"}}, "sampling_params.stop"),
        ({"sampling_params": {**BEAM, "stop_token_ids": [3]}}, "sampling_params.stop_token_ids"),
        ({"sampling_params": {**BEAM, "presence_penalty": 1}}, "sampling_params.presence_penalty"),
        (
            {"sampling_params": {**BEAM, "frequency_penalty": 1}},
            "sampling_params.frequency_penalty",
        ),
        (
            {"sampling_params": {**BEAM, "repetition_penalty": 1.2}},
            "sampling_params.repetition_penalty",
        ),
        ({"sampling_params": {**BEAM, "logit_bias": {"3": 1}}}, "sampling_params.logit_bias"),
        ({"sampling_params": BEAM, "stream": True}, "stream"),
        ({"sampling_params": BEAM, "return_logprob": True}, "return_logprob"),
        ({"sampling_params": BEAM, "return_prompt_logprob": True}, "return_prompt_logprob"),
        ({"sampling_params": {**BEAM, "beam_width": 0}}, "sampling_params.beam_width"),
        ({"sampling_params": {**BEAM, "beam_width": 11}}, "sampling_params.beam_width"),
        ({"sampling_params": {**BEAM, "length_penalty": float("inf")}}, None),  # not JSON
        ({"sampling_params": {"length_penalty": 2.0}}, "sampling_params.length_penalty"),
        ({"sampling_params": {"n": 65}}, "sampling_params.n"),
        ({"sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"text": ["a"] * 30, "sampling_params": {"n": 9}}, "sampling_params.n"),
    ],
)
def test_bad_group_fields_are_400_naming_the_field(extra, param):
    raw = body(**extra)
    if param is None:  # Infinity is not JSON: a 400 of the decoder
        with pytest.raises(ApiError):
            parse_generate(raw, MODEL)
        return
    with pytest.raises(ApiError) as e:
        parse_generate(raw, MODEL)
    assert e.value.param == param and e.value.status == 400, e.value.message


def test_beam_allows_its_own_fields_and_neutral_values():
    sp = {**BEAM, "temperature": 0, "top_k": -1, "ignore_eos": True, "length_penalty": 0.0}
    g = parse_generate(body(sampling_params=sp), MODEL)
    assert (g.gen.beam_width, g.gen.length_penalty) == (2, 0.0)


def test_echo_with_logprobs_and_n_goes_as_independent_requests():
    """Prompt log-probs need each choice to compute the prompt (a fork computes it once,
    without them): those n choices are n requests (n = 1, seed + i)."""
    from radixrt.server.validate import parse_completion

    front = make_front()
    raw = b'{"prompt": "ab", "n": 2, "echo": true, "logprobs": 1, "max_tokens": 2, "seed": 4}'
    g = front.generate(parse_completion(raw, MODEL))
    sent = front.to_scheduler.sent
    assert [(m.params.n, m.params.seed, m.params.prompt_logprobs) for m in sent] == [
        (1, 4, True),
        (1, 5, True),
    ]
    assert [st.index for st in g.states] == [0, 1] and len(front.outputs.states) == 2
