"""Outbox / Generation.batches: one batch per wake-up, one delta per output in it (several
steps' deltas of an output merged, in order), an error after the deltas that came before it,
and `text` kept as parts; the front's record of finished requests that may hold their context
(`HeldRequests`)."""

from __future__ import annotations

import asyncio

import pytest

from radixrt.sampling import SamplingParams
from radixrt.server.protocol import ApiError
from radixrt.server.request_state import Delta, Generation, Outbox, RequestState


def _states(n: int, box: Outbox) -> list[RequestState]:
    return [RequestState(f"r{i}", i, [1, 2], SamplingParams(), None, box, None) for i in range(n)]


def _collect(gen: Generation) -> list:
    async def run():
        out = []
        try:
            async for batch in gen.batches():
                out.append([(st.index, d.text, d.token_ids, d.finish_reason) for st, d in batch])
        except ApiError as e:
            out.append(e.message)
        return out

    return asyncio.run(run())


def test_steps_that_arrive_together_merge_per_output_in_order():
    box = Outbox()
    a, b = _states(2, box)
    gen = Generation([a, b], box, lambda sts: None)
    box.put(a, Delta("x", [1], [-0.5], None, [[(1, -0.5)]]))
    box.put(b, Delta("p", [7], [], None))
    box.put(a, Delta("y", [2], [-0.25], None, [[(2, -0.25)]]))
    box.put(a, Delta("z", [3], [-0.1], "length", [[(3, -0.1)]]))
    box.put(b, Delta("q", [8], [], "stop"))
    (batch,) = _collect(gen)
    assert batch == [(0, "xyz", [1, 2, 3], "length"), (1, "pq", [7, 8], "stop")]


def test_merged_delta_keeps_logprobs_and_tops_aligned():
    box = Outbox()
    (a,) = _states(1, box)
    gen = Generation([a], box, lambda sts: None)
    box.put(a, Delta("x", [1], [-0.5], None, [[(1, -0.5)]]))
    box.put(a, Delta("y", [2], [-0.25], "length", [[(2, -0.25), (9, -3.0)]]))

    async def one():
        async for batch in gen.batches():
            return batch

    ((_, d),) = asyncio.run(one())
    assert d.logprobs == [-0.5, -0.25]
    assert d.top_logprobs == [[(1, -0.5)], [(2, -0.25), (9, -3.0)]]


def test_an_error_comes_after_the_deltas_before_it():
    box = Outbox()
    a, b = _states(2, box)
    gen = Generation([a, b], box, lambda sts: None)
    box.put(a, Delta("x", [1], [], None))
    box.put(b, ApiError("boom", status=500))
    box.put(a, Delta("never", [2], [], "length"))
    assert _collect(gen) == [[(0, "x", [1], None)], "boom"]


def test_a_wake_up_takes_everything_pending():
    """The handler sleeps until something is put; what is put before it runs again comes
    in one batch."""
    box = Outbox()
    (a,) = _states(1, box)
    gen = Generation([a], box, lambda sts: None)

    async def run():
        batches = []

        async def consume():
            async for batch in gen.batches():
                batches.append([d.text for _, d in batch])

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # the consumer waits on the empty outbox
        box.put(a, Delta("a", [1], [], None))
        box.put(a, Delta("b", [2], [], None))
        await asyncio.sleep(0)
        box.put(a, Delta("c", [3], [], "length"))
        await task
        return batches

    assert asyncio.run(run()) == [["ab"], ["c"]]


def test_text_is_kept_as_parts():
    (st,) = _states(1, Outbox())
    assert st.text == ""
    st.text_parts += ["ab", "c", "d"]
    assert st.text == "abcd" and st.text_parts == ["abcd"]
    st.text = "new"
    assert st.text == "new"


@pytest.mark.parametrize("n", [1, 3])
def test_wait_returns_when_every_output_finished(n):
    box = Outbox()
    states = _states(n, box)
    gen = Generation(states, box, lambda sts: None)
    for st in states:
        box.put(st, Delta("t", [1], [], "length"))
        st.finish_reason = "length"
    assert asyncio.run(gen.wait()) == states


def test_held_requests_map_client_ids_per_tenant_until_the_hold_surely_ended():
    """A client id stands for every scheduler request it made (children, reused rids), for
    its tenant only; a record goes when released, when a read of the engine's holds lacks
    it, or when its time-to-live from the finish has passed."""
    from radixrt.server.holds import HeldRequests

    now = [0.0]
    held = HeldRequests(clock=lambda: now[0])
    held.add("acme", "job", "1-t#0", 60)
    held.add("acme", "job", "1-t#1", 60)
    held.add("beta", "job", "2-t", 60)
    held.add(None, "other", "3-t", 5)
    assert held.rids("acme", ["job", "nope"]) == ["1-t#0", "1-t#1"]
    assert held.rids("beta", ["job"]) == ["2-t"] and held.rids("gamma", ["job"]) == []
    assert held.client_ids("acme", ["1-t#1", "2-t", "9-t"]) == ["job"]
    assert held.client_ids("beta", ["1-t#1"]) == []
    held.keep_only(frozenset({"1-t#0", "2-t", "3-t"}))
    assert held.rids("acme", ["job"]) == ["1-t#0"]
    held.forget(["2-t"])
    assert held.rids("beta", ["job"]) == [] and len(held) == 2
    now[0] = 5.0
    assert held.rids(None, ["other"]) == [] and len(held) == 1
    now[0] = 60.0
    assert held.rids("acme", ["job"]) == [] and len(held) == 0 and not held.by_owner
