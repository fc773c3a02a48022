"""One request's failure stays its own, through a live server: a beam search whose scoring
raises inside the scheduler process (injected there through a `sitecustomize` on the server's
PYTHONPATH) gets a 500 and is counted in radixrt_scheduler_failed_requests, while requests
before and after it succeed and /health stays 200 (the scheduler process used to die: 503
for everything after). The reported inputs themselves: extreme length penalties are a 400
naming the field, extreme sampling values give the greedy text."""

from __future__ import annotations

import textwrap
import threading

import pytest
from server_utils import serving, sse_events

BROKEN_PENALTY = 2.75  # the beam search with this length_penalty has a scorer that raises
SITECUSTOMIZE = f"""
import radixrt.scheduler.beam as _beam

_step = _beam.BeamState.step


def _broken_step(self, outputs, top_logprobs):
    if self.length_penalty == {BROKEN_PENALTY!r}:
        raise OverflowError("injected: the length penalty overflowed")
    return _step(self, outputs, top_logprobs)


_beam.BeamState.step = _broken_step
"""
PROMPT = "Once upon a time, in a land far away,"
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    with serving(tiny_model_dir, env={"PYTHONPATH": str(site)}) as srv:
        yield srv


def generate(server, sampling_params, status=200, text=PROMPT):
    got, out = server.post("/generate", {"text": text, "sampling_params": sampling_params})
    assert got == status, out
    return out


def failed_requests(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = server.get("/metrics")
    assert status == 200
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["radixrt_scheduler_failed_requests"]


def test_a_failing_beam_search_fails_alone_and_the_server_serves_on(server):
    before = failed_requests(server)
    events = []
    streaming = {"text": "steady", "sampling_params": {**GREEDY, "max_new_tokens": 24}}
    t = threading.Thread(
        target=lambda: events.extend(
            sse_events(server.url + "/generate", {**streaming, "stream": True})
        )
    )
    t.start()  # in flight while the bad search fails in the same scheduler loop
    bad = {"beam_width": 2, "max_new_tokens": 8, "length_penalty": BROKEN_PENALTY}
    out = generate(server, bad, status=500)
    assert "injected" in out["error"]["message"]
    t.join(60)
    assert events and events[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert len(events[-1]["output_ids"]) == 24  # SGLang's streams carry everything so far
    assert server.get("/health")[0] == 200
    beams = generate(server, {"beam_width": 2, "max_new_tokens": 4, "length_penalty": 1.0})
    assert len(beams) == 2
    assert len(generate(server, GREEDY)["output_ids"]) == 6
    server.wait_idle()  # nothing leaked: integrity holds in the scheduler process
    assert failed_requests(server) == before + 1  # the search, once


@pytest.mark.parametrize("penalty, max_new", [(1000, 8), (-1000, 8), (300, 32)])
def test_reported_length_penalties_are_400_and_leave_the_server_up(server, penalty, max_new):
    sp = {"beam_width": 2, "max_new_tokens": max_new, "length_penalty": penalty}
    out = generate(server, sp, status=400)
    assert out["error"]["param"] == "sampling_params.length_penalty"
    assert "[-10, 10]" in out["error"]["message"]
    assert server.get("/health")[0] == 200
    assert len(generate(server, GREEDY)["output_ids"]) == 6


@pytest.mark.parametrize(
    "extreme",
    [
        {"temperature": 1e-38, "top_k": 1},
        {"temperature": 1e-300},
        {"temperature": 1e308, "top_p": 1e-300},
    ],
    ids=str,
)
def test_reported_sampling_values_give_the_greedy_text(server, extreme):
    want = generate(server, GREEDY)
    got = generate(server, {**GREEDY, **extreme})
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
