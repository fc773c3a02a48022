"""n > 1 and beam search through a live server: one scheduler request per prompt (the prompt
is computed once: fork counters), choices 0..n-1 on /v1/completions, /v1/chat/completions and
/generate (streaming and not), usage counting the prompt once, seeded children reproducible,
greedy children identical, /generate beam search equal to Engine.beam_search, 400s naming the
field, and aborts of the parent mid-fan-out and mid-beam leaving nothing behind."""

from __future__ import annotations

import threading
import time

import pytest
from server_utils import open_raw_stream, read_until, serving, sse_events

from radixrt.sampling import BeamSearchParams

NUM_KV_BLOCKS = 200  # x 16 tokens: room for 3 sequences of 1000 tokens, not 2 of 2000
PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir, "--num-kv-blocks", str(NUM_KV_BLOCKS)) as srv:
        yield srv


def post(server, path, body, status=200):
    got, out = server.post(path, body)
    assert got == status, out
    return out


def snapshot(server):
    return server.wait_idle()["scheduler"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_greedy_choices_on_every_route(server, n):
    before = snapshot(server)
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    comp = post(server, "/v1/completions", {"prompt": PROMPT, "n": n, **base})
    one = post(server, "/v1/completions", {"prompt": PROMPT, **base})
    assert [c["index"] for c in comp["choices"]] == list(range(n))
    assert {c["text"] for c in comp["choices"]} == {one["choices"][0]["text"]}
    usage = comp["usage"]
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]  # once, not n times
    assert usage["completion_tokens"] == 6 * n
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6 * n

    chunks = list(
        sse_events(
            server.url + "/v1/completions",
            {"prompt": PROMPT, "n": n, "stream": True, "stream_options": {"include_usage": True},
             **base},
        )
    )  # fmt: skip
    texts = [""] * n
    for ch in chunks[:-1]:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [one["choices"][0]["text"]] * n
    streamed = chunks[-1]["usage"]
    assert [streamed[k] for k in ("prompt_tokens", "completion_tokens")] == [
        usage["prompt_tokens"],
        usage["completion_tokens"],
    ]

    msgs = [{"role": "user", "content": "Tell me a story."}]
    chat = post(server, "/v1/chat/completions", {"messages": msgs, "n": n, **base})
    assert [c["index"] for c in chat["choices"]] == list(range(n))
    assert len({c["message"]["content"] for c in chat["choices"]}) == 1
    assert chat["usage"]["completion_tokens"] == 6 * n
    stream = list(
        sse_events(server.url + "/v1/chat/completions",
                   {"messages": msgs, "n": n, "stream": True, **base})
    )  # fmt: skip
    content = [""] * n
    finished = set()
    for ch in stream:
        for c in ch["choices"]:
            content[c["index"]] += c["delta"].get("content", "")
            if c["finish_reason"] is not None:
                finished.add(c["index"])
    assert content == [chat["choices"][0]["message"]["content"]] * n
    assert finished == set(range(n))

    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "n": n}
    gen = post(server, "/generate", {"text": PROMPT, "sampling_params": sp})
    outs = gen if n > 1 else [gen]
    assert len(outs) == n and len({tuple(o["output_ids"]) for o in outs}) == 1
    events = list(
        sse_events(server.url + "/generate", {"text": PROMPT, "sampling_params": sp,
                                              "stream": True})
    )  # fmt: skip
    ids: dict[int, list[int]] = {}
    for e in events:  # SGLang's streams: each event has the ids so far
        ids[e.get("index", 0)] = e["output_ids"]
    assert ids == {i: outs[0]["output_ids"] for i in range(n)}

    after = snapshot(server)
    # each of the 6 n > 1 requests (3 routes, streamed or not) forked once: one scheduler
    # request whose prompt was computed once, then shared by reference
    assert after["forks"] - before["forks"] == (6 if n > 1 else 0)


def test_seeded_choices_reproduce(server):
    base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    group = post(server, "/v1/completions", {**base, "n": 3, "seed": 11})
    again = post(server, "/v1/completions", {**base, "n": 3, "seed": 11})
    texts = [c["text"] for c in group["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    singles = [
        post(server, "/v1/completions", {**base, "seed": 11 + i})["choices"][0]["text"]
        for i in range(3)
    ]
    assert texts == singles  # child i samples with seed + i


def test_stop_string_ends_one_choice(server):
    sp = {"max_new_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True, "n": 4}
    free = post(server, "/generate", {"text": PROMPT, "sampling_params": sp})
    # a stop string taken from one choice's text: that choice ends there, others may go on
    windows = [
        c["text"][i : i + 2]
        for c in free[1:]
        for i in range(len(c["text"]) // 2, len(c["text"]) - 1)
    ]
    stop = next((w for w in windows if w.strip()), None)
    assert stop is not None, f"no non-blank 2-character window in {free}"
    assert any(stop in c["text"] for c in free)
    cut = post(server, "/generate", {"text": PROMPT, "sampling_params": {**sp, "stop": stop}})
    for full, c in zip(free, cut):
        if stop in full["text"]:
            assert c["meta_info"]["finish_reason"] == {"type": "stop"}
            assert c["text"] == full["text"][: full["text"].index(stop)]
        else:
            assert c["text"] == full["text"]
    snapshot(server)


@pytest.mark.parametrize("width, penalty", [(2, 1.0), (3, 0.5)])
def test_beam_search_equals_engine(server, make_engine, width, penalty):
    prompts = [PROMPT, "The weather today is"]
    sp = {"beam_width": width, "max_new_tokens": 6, "length_penalty": penalty}
    before = snapshot(server)
    outs = post(server, "/generate", {"text": prompts, "sampling_params": sp})
    single = post(server, "/generate", {"text": prompts[1], "sampling_params": sp})
    engine = make_engine()
    ref = engine.beam_search(prompts, BeamSearchParams(width, 6, penalty))
    assert len(outs) == 2 * width and len(single) == width
    for i, r in enumerate(ref):
        got = outs[i * width : (i + 1) * width]
        assert [o["meta_info"]["index"] for o in got] == list(range(width))
        assert [o["output_ids"] for o in got] == [s.token_ids for s in r.sequences]
        assert [o["text"] for o in got] == [s.text for s in r.sequences]
        assert [o["meta_info"]["score"] for o in got] == pytest.approx(
            [s.score for s in r.sequences], abs=1e-4
        )
        assert [o["meta_info"]["cumulative_logprob"] for o in got] == pytest.approx(
            [s.cumulative_logprob for s in r.sequences], abs=1e-4
        )
        scores = [o["meta_info"]["score"] for o in got]
        assert scores == sorted(scores, reverse=True)
    assert [o["output_ids"] for o in single] == [s.token_ids for s in ref[1].sequences]
    after = snapshot(server)
    assert after["beam_steps"] > before["beam_steps"]
    assert after["forks"] - before["forks"] >= 3


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "n": 65}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 2000}, "n"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2000}, "n"),
        ("/generate", {"text": "hi", "sampling_params": {"n": 2, "max_new_tokens": 2000}},
         "sampling_params.n"),
        ("/generate", {"text": "hi", "sampling_params": {"beam_width": 2, "max_new_tokens": 2000}},
         "sampling_params.beam_width"),
        ("/generate", {"text": "hi", "sampling_params": {"beam_width": 11}},
         "sampling_params.beam_width"),
        # the tiny model has 2 EOS ids: 3 x 7 candidates > the 20 top log-probs of a row
        ("/generate", {"text": "hi", "sampling_params": {"beam_width": 7}},
         "sampling_params.beam_width"),
        ("/generate", {"text": "hi", "sampling_params": {"beam_width": 2, "temperature": 0.5}},
         "sampling_params.temperature"),
        ("/generate", {"text": "hi", "sampling_params": {"beam_width": 2}, "stream": True},
         "stream"),
        ("/generate", {"text": "hi", "sampling_params": {"length_penalty": 2}},
         "sampling_params.length_penalty"),
    ],
)  # fmt: skip
def test_bad_fields_are_400_and_nothing_is_queued(server, path, body, param):
    before = snapshot(server)
    out = post(server, path, body, status=400)
    assert out["error"]["param"] == param, out
    after = snapshot(server)
    assert after["steps"] == before["steps"] and after["prompt_tokens"] == before["prompt_tokens"]


def test_client_gone_mid_fan_out_aborts_every_child(server):
    body = {
        "prompt": PROMPT, "n": 3, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    sock = open_raw_stream(server.port, "/v1/completions", body)
    assert b"data: " in read_until(sock, b"data: ")
    assert server.state()["scheduler"]["running"] >= 1
    sock.close()
    state = server.wait_idle(timeout=15)  # every child's KV freed; integrity holds
    assert state["in_flight"] == 0


def test_abort_mid_beam_by_rid(server):
    result = []
    sp = {"beam_width": 3, "max_new_tokens": 1000, "ignore_eos": True}

    def run():
        result.append(server.post("/generate", {"text": PROMPT, "sampling_params": sp,
                                                "rid": "beam-job"}))  # fmt: skip

    before = server.state()["scheduler"]["beam_steps"]  # the module's server ran beams before
    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and server.state()["scheduler"]["beam_steps"] <= before:
        time.sleep(0.02)
    status, out = server.post("/abort", {"rid": "beam-job"})
    assert status == 200 and out["aborted"] == 1
    t.join(20)
    assert not t.is_alive()
    assert result[0] == (200, [])  # aborted: no finished sequences
    server.wait_idle(timeout=10)


def test_abort_mid_fan_out_by_rid(server):
    events = []
    body = {"text": PROMPT, "stream": True, "rid": "fan-job",
            "sampling_params": {"n": 3, "max_new_tokens": 1000, "ignore_eos": True}}  # fmt: skip

    def consume():
        events.extend(sse_events(server.url + "/generate", body, timeout=30))

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 15
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    status, out = server.post("/abort", {"rid": "fan-job"})
    assert status == 200 and out["aborted"] == 3
    t.join(20)
    assert not t.is_alive()
    reasons = {e["index"]: e["meta_info"]["finish_reason"] for e in events if
               e["meta_info"]["finish_reason"]}  # fmt: skip
    assert reasons == {i: {"type": "abort"} for i in range(3)}
    server.wait_idle(timeout=10)


def test_metrics_carry_the_fork_and_beam_counters(server):
    from prometheus_client.parser import text_string_to_metric_families

    sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    post(server, "/generate", {"text": PROMPT, "sampling_params": {**sp, "n": 2}})
    post(
        server,
        "/generate",
        {"text": PROMPT, "sampling_params": {"beam_width": 2, "max_new_tokens": 3}},
    )
    snap = snapshot(server)
    status, text = server.get("/metrics")
    assert status == 200
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("forks", "fork_shared_blocks", "fork_copied_blocks", "beam_steps",
                 "beam_shared_blocks", "beam_copied_blocks"):  # fmt: skip
        assert values[f"radixrt_{name}"] == snap[name], name
    assert snap["forks"] >= 2 and snap["beam_steps"] >= 1


def test_beam_width_cap_counts_eos_ids(server):
    """Without EOS in play (ignore_eos) a beam ranks 2 x W candidates: W = 7 runs."""
    sp = {"beam_width": 7, "max_new_tokens": 3, "ignore_eos": True}
    outs = post(server, "/generate", {"text": "hi", "sampling_params": sp})
    assert len(outs) == 7 and all(len(o["output_ids"]) == 3 for o in outs)
    status, out = server.post(
        "/generate", {"text": "hi", "sampling_params": {**sp, "ignore_eos": False}}
    )
    assert status == 400 and "EOS" in out["error"]["message"], out
