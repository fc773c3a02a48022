"""`Front` without processes: every path a request can take (finish, scheduler error,
abort, client gone, scheduler death, send and encoding failures) removes its state, and
the scheduler only ever sees the front's own request ids."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixrt.deltas import FinishReason, RequestDelta
from radixrt.server.channel import MsgpackCodec
from radixrt.server.front import Front
from radixrt.server.messages import (
    AbortRequest,
    Ready,
    RequestError,
    TokenBatchOut,
    TokenizedRequest,
    ToScheduler,
)
from radixrt.server.metrics import ServerMetrics
from radixrt.server.protocol import ApiError, ModelInfo
from radixrt.server.validate import parse_generate

READY = Ready(pid=1, max_model_len=64, vocab_size=100, kv_blocks_total=8, block_size=16)
MODEL = ModelInfo("m", READY.vocab_size, READY.max_model_len)


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class FakeChannel:
    """Records what the front sends (decoded), or fails to send / encode."""

    def __init__(self, fail_send: bool = False, fail_encode: bool = False) -> None:
        self.codec = MsgpackCodec(ToScheduler)
        self.sent: list = []
        self.fail_send = fail_send
        if fail_encode:
            self.codec.encode = self._overflow

    def _overflow(self, msg):
        raise OverflowError("can't serialize ints > 2**64 - 1")

    def send_encoded(self, data: bytes) -> None:
        if self.fail_send:
            raise ConnectionError("no receiver")
        self.sent.append(self.codec.decode(data))


def make_front(**channel) -> Front:
    front = Front(CharTokenizer(), FakeChannel(**channel), None, ServerMetrics(), "m")
    front._dispatch(READY)
    return front


def spec(body: bytes):
    g = parse_generate(body, MODEL)
    return g.gen, g.rid


def out(rid: str, ids: list[int], reason: str | None = None) -> RequestDelta:
    return RequestDelta(rid, ids, reason and FinishReason(reason), 3, 0, 0)


def batch(outputs=(), errors=()) -> TokenBatchOut:
    from radixrt.server.front_outputs import initial_snapshot

    return TokenBatchOut(list(outputs), list(errors), initial_snapshot(READY))


def run(coro):
    return asyncio.run(coro)


def test_internal_ids_only_and_finish_forgets():
    async def main():
        front = make_front()
        gen, rid = spec(
            b'{"text": ["ab", "cd"], "rid": "col", "sampling_params": {"max_new_tokens": 2}}'
        )
        g = front.generate(gen, rid)
        sent = [m.rid for m in front.to_scheduler.sent]
        assert len(sent) == 2 and len(set(sent)) == 2 and "col" not in sent
        assert not any(r.startswith("col") for r in sent)
        # a client rid equal to an internal one is just another client rid
        other, _ = spec(b'{"text": "x"}')
        front.generate(other, sent[0])
        with pytest.raises(ApiError, match="in use"):
            front.generate(other, "col")
        for r in sent:
            front._dispatch(batch([out(r, [1, 2], "length")]))
        states = await g.wait()
        assert [st.finish_reason for st in states] == ["length", "length"]
        assert "col" not in front.outputs.by_client_rid and len(front.outputs.states) == 1

    run(main())


def test_scheduler_error_then_client_gone_forgets_all():
    async def main():
        front = make_front()
        gen, rid = spec(b'{"text": ["ab", "cd"], "rid": "r"}')
        g = front.generate(gen, rid)
        first, second = (m.rid for m in front.to_scheduler.sent)
        front._dispatch(batch(errors=[RequestError(first, "too big")]))
        with pytest.raises(ApiError, match="too big"):
            async with g:
                await g.wait()
        assert front.outputs.states == {} and front.outputs.by_client_rid == {}
        assert front.to_scheduler.sent[-1] == AbortRequest(second)

    run(main())


def test_abort_by_client_rid_and_own_id():
    async def main():
        front = make_front()
        gen, _ = spec(b'{"text": "ab"}')
        g = front.generate(gen, "mine")
        assert front.abort_client_rid("mine") == 1
        assert front.abort_client_rid("nobody") == 0
        (req,) = [m for m in front.to_scheduler.sent if isinstance(m, TokenizedRequest)]
        front._dispatch(batch([out(req.rid, [], "abort")]))
        (st,) = await g.wait()
        assert st.finish_reason == "abort" and front.outputs.states == {}
        g2 = front.generate(gen)  # no client rid: /abort takes the request's own id
        own = g2.states[0].rid
        assert front.abort_client_rid(own) == 1

    run(main())


def test_scheduler_death_fails_and_forgets_everything():
    async def main():
        front = make_front()
        gen, _ = spec(b'{"text": ["a", "b", "c"]}')
        g = front.generate(gen, "x")
        front.stop_serving("the scheduler process exited with code -9")
        with pytest.raises(ApiError) as e:
            await g.wait()
        assert e.value.status == 503
        assert front.outputs.states == {} and front.outputs.by_client_rid == {}
        with pytest.raises(ApiError):
            front.model_info()

    run(main())


def test_send_failure_fails_and_forgets():
    async def main():
        front = make_front(fail_send=True)
        gen, _ = spec(b'{"text": "ab"}')
        g = front.generate(gen, "x")
        with pytest.raises(ApiError) as e:
            await g.wait()
        assert e.value.status == 503
        assert front.outputs.states == {} and front.outputs.by_client_rid == {}

    run(main())


def test_encoding_failure_keeps_no_state():
    async def main():
        front = make_front(fail_encode=True)
        gen, _ = spec(b'{"text": "ab"}')
        with pytest.raises(ApiError) as e:
            front.generate(gen, "x")
        assert e.value.status == 500
        assert front.outputs.states == {} and front.outputs.by_client_rid == {}

    run(main())


def test_stop_string_finishes_with_stop():
    async def main():
        front = make_front()
        gen, _ = spec(b'{"text": "ab", "sampling_params": {"stop": "cd"}}')
        g = front.generate(gen)
        rid = g.states[0].rid
        front._dispatch(batch([out(rid, [0, 1, 2, 3])]))  # "abcd": the stop string
        assert front.to_scheduler.sent[-1] == AbortRequest(rid, reason="stop")
        front._dispatch(batch([out(rid, [4], "stop")]))
        (st,) = await g.wait()
        assert (st.text, st.finish_reason) == ("ab", "stop") and front.outputs.states == {}

    run(main())


def test_metrics_from_ready_and_in_flight():
    front = make_front()
    text = front.metrics.render().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["radixrt_kv_blocks_free"] == values["radixrt_kv_blocks_total"] == 8
    assert values["radixrt_front_in_flight"] == 0 and values["radixrt_ready"] == 1
    assert front.outputs.snapshot is not None and front.outputs.snapshot.stats.kv_blocks_free == 8
    front.stop_serving("gone")
    text = front.metrics.render().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert (
        values["radixrt_ready"] == 0
        and values["radixrt_kv_blocks_free"] != values["radixrt_kv_blocks_free"]
    )


def test_scheduler_fault_on_one_request_is_a_500():
    async def main():
        front = make_front()
        gen, _ = spec(b'{"text": "ab"}')
        g = front.generate(gen)
        rid = g.states[0].rid
        front._dispatch(batch(errors=[RequestError(rid, "planning failed: KeyError", 500)]))
        with pytest.raises(ApiError) as e:
            await g.wait()
        assert (e.value.status, e.value.type) == (500, "server_error")
        assert front.outputs.states == {}
        assert front.metrics.internal_errors._value.get() == 1  # a server bug, counted


def test_scheduler_grammar_error_names_the_field_the_client_used():
    """The scheduler names the SamplingParams field ("grammar"); the client sent "ebnf"."""

    async def main():
        front = make_front()
        body = b'{"text": "ab", "sampling_params": {"ebnf": "root ::= root"}}'
        gen, _ = spec(body)
        g = front.generate(gen)
        rid = g.states[0].rid
        error = RequestError(rid, "invalid grammar: no output can match it", 400, param="grammar")
        front._dispatch(batch(errors=[error]))
        with pytest.raises(ApiError) as e:
            await g.wait()
        assert (e.value.status, e.value.param) == (400, "sampling_params.ebnf")
        assert front.metrics.internal_errors._value.get() == 0

    run(main())
