"""Bad input gets HTTP 400 with an OpenAI-shaped error naming the problem; the server
keeps serving (a good request running meanwhile is unaffected)."""

from __future__ import annotations

import threading

import pytest
from server_utils import serving, sse_events

# 16 blocks of 16 tokens: a request may pass the front's context check (2048 tokens) and
# still be refused by the scheduler (KV pool), which must come back as a 400.
POOL_ARGS = ("--num-kv-blocks", "16", "--block-size", "16")

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
GEN = "/generate"
USER = [{"role": "user", "content": "hi"}]

# (path, body, param or None, words the message must contain)
BAD = {
    "malformed_json": (COMP, b'{"prompt": "a",', None, ["JSON"]),
    "empty_body": (COMP, b"", None, ["empty"]),
    "not_an_object": (COMP, b"[1, 2]", None, ["object"]),
    "missing_prompt": (COMP, {"max_tokens": 3}, "prompt", ["prompt"]),
    "prompt_wrong_type": (COMP, {"prompt": 3}, "prompt", ["prompt"]),
    "max_tokens_wrong_type": (COMP, {"prompt": "a", "max_tokens": "ten"}, "max_tokens", ["int"]),
    "max_tokens_bool": (COMP, {"prompt": "a", "max_tokens": True}, "max_tokens", ["int"]),
    "negative_max_tokens": (COMP, {"prompt": "a", "max_tokens": -1}, "max_tokens", [">= 0"]),
    "empty_prompt": (COMP, {"prompt": ""}, "prompt", ["empty"]),
    "empty_prompt_list": (COMP, {"prompt": []}, "prompt", ["empty"]),
    "mixed_prompt_list": (COMP, {"prompt": ["a", 1]}, "prompt", ["list"]),
    "too_long": (
        COMP,
        {"prompt": [5] * 2000, "max_tokens": 100},
        "max_tokens",
        ["2048", "2100", "2000"],
    ),
    "prompt_over_context": (COMP, {"prompt": [5] * 2048, "max_tokens": 0}, "prompt", ["2048"]),
    "token_outside_vocab": (COMP, {"prompt": [5, 99999]}, "prompt", ["99999", "vocabulary"]),
    "negative_token": (COMP, {"prompt": [[5, -1]]}, "prompt", ["-1", "vocabulary"]),
    "temperature": (COMP, {"prompt": "a", "temperature": -1}, "temperature", ["temperature=-1"]),
    "top_p": (COMP, {"prompt": "a", "top_p": 0}, "top_p", ["top_p=0", "(0, 1]"]),
    "min_p": (COMP, {"prompt": "a", "min_p": 2}, "min_p", ["min_p=2"]),
    "presence_penalty": (
        COMP,
        {"prompt": "a", "presence_penalty": 5},
        "presence_penalty",
        ["[-2, 2]"],
    ),
    "repetition_penalty": (
        COMP,
        {"prompt": "a", "repetition_penalty": 0},
        "repetition_penalty",
        ["[0.01, 100]"],
    ),
    "empty_stop": (COMP, {"prompt": "a", "stop": [""]}, "stop", ["stop"]),
    "n_zero": (COMP, {"prompt": "a", "n": 0}, "n", ["n=0"]),
    "stream_wrong_type": (COMP, {"prompt": "a", "stream": "yes"}, "stream", ["bool"]),
    "chat_missing_messages": (CHAT, {"max_tokens": 3}, "messages", ["messages"]),
    "chat_message_without_role": (
        CHAT,
        {"messages": [{"content": "x"}]},
        "messages[0].role",
        ["missing", "role"],
    ),
    "chat_empty_messages": (CHAT, {"messages": []}, "messages", ["empty"]),
    "chat_bad_role": (
        CHAT,
        {"messages": [{"role": "robot", "content": "x"}]},
        "messages",
        ["robot"],
    ),
    "chat_content_type": (
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
        ["content"],
    ),
    "chat_image_part": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content",
        ["image_url"],
    ),
    "chat_too_long": (
        CHAT,
        {"messages": USER, "max_completion_tokens": 5000},
        "max_completion_tokens",
        ["2048"],
    ),
    "generate_both_inputs": (GEN, {"text": "a", "input_ids": [1]}, "text", ["exactly one"]),
    "generate_no_input": (GEN, {"sampling_params": {}}, "text", ["exactly one"]),
    "generate_ids_as_text": (GEN, {"input_ids": ["a"]}, "input_ids", ["token ids"]),
    "generate_bad_sampling": (
        GEN,
        {"text": "a", "sampling_params": {"top_k": 0.5}},
        "sampling_params.top_k",
        ["int"],
    ),
    "generate_logprob_start": (
        GEN,
        {"text": "a", "logprob_start_len": -2},
        "logprob_start_len",
        [">= -1"],
    ),
    "generate_empty_text": (GEN, {"text": ""}, "text", ["empty"]),
    # passes the front's checks; the scheduler refuses it (KV pool of 16 blocks)
    "kv_pool_too_small": (
        GEN,
        {"text": "a", "sampling_params": {"max_new_tokens": 1000}},
        "sampling_params.max_new_tokens",
        ["KV blocks"],
    ),
    "abort_without_rid": ("/abort", {}, "rid", ["rid"]),
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir, *POOL_ARGS) as srv:
        yield srv


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_400(server, case):
    path, body, param, words = BAD[case]
    status, out = server.post(path, body, timeout=10)
    assert status == 400, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] is None
    assert err["param"] == param, err
    for word in words:
        assert word in err["message"], err["message"]


def test_bad_stream_request_is_400_not_a_stream(server):
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1000}, "stream": True}
    status, out = server.post(GEN, body, timeout=10)
    assert status == 400 and "KV blocks" in out["error"]["message"]


def test_unknown_route_and_method(server):
    status, out = server.get("/v1/nothing")
    assert status == 404 and "error" in out
    status, out = server.get(COMP)
    assert status == 405 and "error" in out


def test_good_request_unaffected_by_bad_ones(server):
    events = []
    body = {"text": "steady", "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
    t = threading.Thread(
        target=lambda: events.extend(sse_events(server.url + GEN, {**body, "stream": True}))
    )
    t.start()
    for path, bad, _, _ in BAD.values():
        assert server.post(path, bad, timeout=10)[0] == 400
    t.join(30)
    assert events and events[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert len(events[-1]["output_ids"]) == 24
    assert server.get("/health")[0] == 200
    status, out = server.post(COMP, {"prompt": "still fine", "max_tokens": 2})
    assert status == 200 and out["usage"]["completion_tokens"] <= 2
    server.wait_idle()
