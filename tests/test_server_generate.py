"""The native POST /generate contract, /abort, and aborts on client disconnect (KV freed,
other streams unaffected)."""

from __future__ import annotations

import threading
import time

import pytest
from server_utils import open_raw_stream, read_until, serving, sse_events

from radixrt import SamplingParams

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}  # seconds on CPU


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir) as srv:
        yield srv


def generate(server, body):
    status, out = server.post("/generate", body)
    assert status == 200, out
    return out


def test_single_and_list_inputs(server):
    texts = ["Once upon a time", "The weather today is", "1, 2, 3,"]
    singles = [generate(server, {"text": t, "sampling_params": GREEDY}) for t in texts]
    for out in singles:
        meta = out["meta_info"]
        assert len(out["output_ids"]) == meta["completion_tokens"] == 8
        assert meta["finish_reason"] == {"type": "length"}
        assert meta["prompt_tokens"] > 0 and meta["cached_tokens"] >= 0
        assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str)
        assert "output_token_logprobs" not in meta and "input_token_logprobs" not in meta
    batch = generate(server, {"text": texts, "sampling_params": GREEDY})
    assert [o["output_ids"] for o in batch] == [o["output_ids"] for o in singles]
    assert [o["text"] for o in batch] == [o["text"] for o in singles]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in batch)  # second time: cached
    ids = [[5, 6, 7, 8], [9, 10]]
    by_ids = generate(server, {"input_ids": ids, "sampling_params": GREEDY})
    one = generate(server, {"input_ids": ids[1], "sampling_params": GREEDY})
    assert isinstance(one, dict) and by_ids[1]["output_ids"] == one["output_ids"]
    assert by_ids[0]["meta_info"]["prompt_tokens"] == 4


def test_stream_matches_non_stream(server):
    body = {"text": "Streaming is", "sampling_params": GREEDY, "return_logprob": True}
    full = generate(server, body)
    events = list(sse_events(server.url + "/generate", {**body, "stream": True}))
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    # SGLang's streaming: each event carries the text, ids and log-probs so far
    for before, after in zip(events, events[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    last = events[-1]
    assert last["text"] == full["text"] and last["output_ids"] == full["output_ids"]
    entries = last["meta_info"]["output_token_logprobs"]
    expected = full["meta_info"]["output_token_logprobs"]
    assert [e[1:] for e in entries] == [e[1:] for e in expected]
    assert [e[0] for e in entries] == pytest.approx([e[0] for e in expected], abs=1e-5)
    assert len(entries) == 8 and all(lp <= 0 and text is None for lp, _, text in entries)
    assert [e[1] for e in entries] == full["output_ids"]
    batch = list(
        sse_events(server.url + "/generate", {"text": ["a b", "c d"], "sampling_params": GREEDY,
                                              "stream": True})
    )  # fmt: skip
    assert {e["index"] for e in batch} == {0, 1}
    assert sum(e["meta_info"]["finish_reason"] is not None for e in batch) == 2


def test_prompt_logprobs_match_engine(server, tiny_model_dir):
    from radixrt import Engine

    prompt = "The quick brown fox jumps over the lazy dog"
    engine = Engine(tiny_model_dir, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=0, prompt_logprobs=True, logprob_start_len=3)
    exp = engine.generate([prompt], params)[0]
    engine.shutdown()
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 0},
        "return_prompt_logprob": True,
        "logprob_start_len": 3,
    }
    out = generate(server, body)
    entries = out["meta_info"]["input_token_logprobs"]  # [logprob, token id, None]
    lps = [e[0] for e in entries]
    assert len(lps) == exp.prompt_tokens - 3 > 0
    assert lps == pytest.approx(exp.prompt_logprobs, abs=1e-4)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length"}
    from_zero = generate(server, {**body, "logprob_start_len": 0})
    first, *rest = from_zero["meta_info"]["input_token_logprobs"]
    assert first[0] is None and len(rest) == exp.prompt_tokens - 1
    assert [e[0] for e in rest[2:]] == pytest.approx(lps, abs=1e-4)
    assert [first[1]] + [e[1] for e in rest] == engine_ids(tiny_model_dir, prompt)


def engine_ids(model_dir, text):
    from radixrt.hf_dir import load_tokenizer

    return load_tokenizer(model_dir).encode(text)


def test_abort_by_rid(server):
    events = []

    def consume():
        body = {"text": "abort me", "sampling_params": LONG, "stream": True, "rid": "job-1"}
        events.extend(sse_events(server.url + "/generate", body, timeout=30))

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    status, out = server.post("/abort", {"rid": "job-1"})
    assert status == 200 and out["aborted"] == 1
    t.join(15)
    assert not t.is_alive()
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "abort"}
    assert len(events[-1]["output_ids"]) < 2000
    server.wait_idle(timeout=5)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_kv(server, stream):
    results = []

    def other(i):
        body = {"text": f"other stream {i}", "sampling_params": GREEDY, "stream": True}
        results.append(list(sse_events(server.url + "/generate", body, timeout=30)))

    before = server.wait_idle()["scheduler"]["generated_tokens"]
    path_body = {"text": "I will vanish", "sampling_params": LONG, "stream": stream}
    sock = open_raw_stream(server.port, "/generate", path_body)
    others = [threading.Thread(target=other, args=(i,)) for i in range(3)]
    try:
        if stream:
            assert b"data: " in read_until(sock, b"data: ")
        else:  # wait until the request runs in the scheduler
            deadline = time.monotonic() + 10
            while server.state()["scheduler"]["running"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        for t in others:
            t.start()
    finally:
        sock.close()  # the client is gone mid-generation
    for t in others:
        t.join(30)
    assert len(results) == 3
    for events in results:
        assert events[-1]["meta_info"]["finish_reason"] == {"type": "length"}
        assert len(events[-1]["output_ids"]) == 8
    st = server.wait_idle(timeout=5)
    # the vanished request was cut short: far fewer than its 2000 tokens were generated
    assert st["scheduler"]["generated_tokens"] - before < 3 * 8 + 1000
