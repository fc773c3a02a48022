"""A live replica as a router's worker: metadata, load, cache flush under load (running
requests unaffected, integrity after), generation health, version, vLLM's tokenize /
detokenize, KV event sources, GET /v1/models/{id}, retention holds (POST
/release_cache_holds, GET /cache_pressure); and the honoured SGLang / vLLM fields
end to end (min_tokens, stop_regex, no_stop_trim, continuous_usage_stats,
continue_final_message, unknown names, --strict-fields)."""

from __future__ import annotations

import re
import threading

import pytest
from server_utils import http_call, serving, sse_events

KEY = "worker-key"
LONG = {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir, "--log-level", "info", api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from radixrt.hf_dir import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def ok(server, path, body=None):
    status, out = server.get(path) if body is None else server.post(path, body)
    assert status == 200, (path, out)
    return out


def test_metadata_routes(server, tiny_model_dir):
    for path in ("/server_info", "/get_server_info"):
        info = ok(server, path)
        assert info["model_path"] == tiny_model_dir == info["tokenizer_path"]
        assert info["served_model_name"] == tiny_model_dir
        assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
        assert info["dp_size"] == 1 and info["kv_block_size"] == 16
        assert info["max_total_tokens"] == 16 * 4096 and info["max_running_requests"] > 0
        assert len(info["instance_id"]) == 32 and info["version"]
        # the scheduler's own config (policy "auto" resolved): lpm over the radix cache
        assert info["schedule_policy"] == "lpm" and info["prefix_cache"] == "radix"
        assert info["disable_radix_cache"] is False
    for path in ("/model_info", "/get_model_info"):
        info = ok(server, path)
        assert info["model_path"] == tiny_model_dir and info["is_generation"] is True
        assert info["architectures"] == ["LlamaForCausalLM"]
    assert ok(server, "/version")["version"] == info_version(server)
    assert ok(server, "/kv_event_sources") == []
    assert ok(server, "/health_generate") == {"status": "ok"}
    card = ok(server, "/v1/models/" + tiny_model_dir.rsplit("/", 1)[-1])
    assert card["id"] == tiny_model_dir
    assert ok(server, "/v1/models/default")["id"] == tiny_model_dir
    status, out = server.get("/v1/models/gpt-4")
    assert status == 404 and out["error"]["param"] == "model"
    status, _ = http_call(server.url + "/flush_cache", {}, headers={})  # no API key
    assert status == 401


def info_version(server):
    return ok(server, "/server_info")["version"]


def test_load_and_flush_under_load(server):
    """Flushing while requests run leaves them unaffected (same greedy text as alone) and
    the pool consistent; the cache is empty after a flush when nothing runs."""
    body = {"text": "The flush test begins", "sampling_params": LONG}
    alone = ok(server, "/generate", body)
    for i in range(6):  # fill the cache with prefixes
        ok(server, "/v1/completions", {"prompt": f"fill {i} " * 20, "max_tokens": 2})
    results: list = []
    started = threading.Barrier(4)

    def stream(i):
        events = []
        for event in sse_events(
            server.url + "/generate", {**body, "stream": True}, server.headers()
        ):
            if not events:
                started.wait(60)  # the load below is sampled while all three run
            events.append(event)
        results.append(events[-1])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(60)
    loads = []
    for _ in range(3):
        loads.append(ok(server, "/get_load"))
        out = ok(server, "/flush_cache", {})
        assert out["success"] is True
    for t in threads:
        t.join(60)
    assert [r["text"] for r in results] == [alone["text"]] * 3
    assert all(r["output_ids"] == alone["output_ids"] for r in results)
    assert all(len(load) == 1 and load[0]["dp_rank"] == 0 for load in loads)
    assert any(load[0]["num_reqs"] > 0 and load[0]["num_tokens"] > 0 for load in loads)
    assert {"num_waiting_reqs", "num_running_reqs"} <= set(loads[0][0])
    server.wait_idle()  # integrity holds (the scheduler checks it after every flush too)
    ok(server, "/v1/completions", {"prompt": "cached again " * 20, "max_tokens": 2})
    server.wait_idle()
    assert ok(server, "/flush_cache", {})["freed_blocks"] > 0
    idle = ok(server, "/get_load")[0]
    assert idle["num_reqs"] == 0
    assert "integrity check failed" not in server.output(None)


PRESSURE_FIELDS = {
    "num_blocks", "block_size", "free_blocks", "evictable_blocks", "held_blocks",
    "max_held_blocks", "holds_refused", "held",
}  # fmt: skip


def test_release_cache_holds_and_cache_pressure(server):
    """A request with cache_ttl_s holds its context under the id the client saw (its rid,
    else the front's id; n > 1: every child); releasing ends the holds once; unknown ids
    count 0; a body that is not a list of ids is a 400 naming rids."""
    sampling = {"max_new_tokens": 6, "temperature": 0}
    prompt = "Hold this context for the agent's next step, please. " * 3
    before = ok(server, "/cache_pressure")
    assert set(before) == PRESSURE_FIELDS and before["held"] == [] and before["held_blocks"] == 0
    body = {"text": prompt, "sampling_params": sampling, "cache_ttl_s": 60, "rid": "agent-1"}
    assert ok(server, "/generate", body)["meta_info"]["id"] == "agent-1"
    seeded = {**sampling, "n": 2, "temperature": 1.0, "seed": 7}
    outs = ok(server, "/generate", {"text": "Two ways " + prompt, "sampling_params": seeded,
                                     "cache_ttl_s": 60})  # fmt: skip
    assert len(outs) == 2 and outs[0]["output_ids"] != outs[1]["output_ids"]
    both = outs[0]["meta_info"]["id"]  # the front's id: one for the request's choices
    assert outs[1]["meta_info"]["id"] == both
    ok(server, "/generate", {"text": "No hint " + prompt, "sampling_params": sampling})
    held = ok(server, "/cache_pressure")
    assert held["held"] == sorted(["agent-1", both]) and held["held_blocks"] > 0
    assert held["max_held_blocks"] == int(0.8 * held["num_blocks"]) and held["block_size"] == 16
    release = "/release_cache_holds"
    assert ok(server, release, {"rids": ["agent-1", "never-sent"]}) == {"released": 1}
    assert ok(server, "/cache_pressure")["held"] == [both]
    assert ok(server, release, {"rids": ["agent-1"]}) == {"released": 0}  # once
    assert ok(server, release, {"rids": [both]}) == {"released": 2}  # every child
    after = ok(server, "/cache_pressure")
    assert after["held"] == [] and after["held_blocks"] == 0
    assert ok(server, release, {"rids": []}) == {"released": 0}
    # the OpenAI routes' requests are known by their response's id
    for path, body in (
        ("/v1/completions", {"prompt": prompt, "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
    ):
        rid = ok(server, path, {**body, "cache_ttl_s": 60, "max_tokens": 4})["id"]
        assert ok(server, "/cache_pressure")["held"] == [rid]
        assert ok(server, release, {"rids": [rid]}) == {"released": 1}
    assert ok(server, "/cache_pressure")["held_blocks"] == 0
    for bad in ({}, {"rids": "agent-1"}, {"rids": [1]}, {"rids": ["x"] * 1025},
                {"rids": ["x" * 257]}):  # fmt: skip
        status, out = server.post(release, bad)
        assert status == 400 and out["error"]["param"].split("[")[0] == "rids", (bad, out)
    for path, body in (("/cache_pressure", None), (release, {"rids": []})):
        status, _ = http_call(
            server.url + path, body, headers={}, method="GET" if body is None else "POST"
        )
        assert status == 401  # the API key is required
    server.wait_idle()


def test_tokenize_and_detokenize(server, tokenizer):
    text = "Hello there, tokenizer"
    out = ok(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    ids = tokenizer.encode(text)
    assert out["tokens"] == ids and out["count"] == len(ids) and out["max_model_len"] == 2048
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    plain = ok(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    chat = ok(server, "/tokenize", {"messages": messages, "model": None})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert ok(server, "/detokenize", {"tokens": ids})["prompt"] == tokenizer.decode(ids)
    status, out = server.post("/detokenize", {"tokens": [1, 999999]})
    assert status == 400 and out["error"]["param"] == "tokens"


def greedy_completion(server, prompt, **fields):
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **fields}
    return ok(server, "/v1/completions", body)["choices"][0]


def test_min_tokens_masks_stop_token_ids(server, tokenizer):
    prompt = "Counting words: one"
    base = ok(
        server, "/generate", {"text": prompt, "sampling_params": {**LONG, "max_new_tokens": 6}}
    )
    first = base["output_ids"][0]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop_token_ids": [first]}
    stopped = ok(server, "/v1/completions", body)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1
    kept = ok(server, "/v1/completions", {**body, "min_tokens": 4})
    assert kept["usage"]["completion_tokens"] >= 4
    sp = {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first], "min_new_tokens": 4}
    out = ok(server, "/generate", {"text": prompt, "sampling_params": sp})
    assert first not in out["output_ids"][:4] and out["meta_info"]["completion_tokens"] >= 4


def test_stop_regex_and_no_stop_trim(server):
    prompt = "Once upon a time there"
    full = greedy_completion(server, prompt)["text"]
    words = re.findall(r"[A-Za-z]{3,}", full)
    assert words, full
    word = words[len(words) // 2]
    pattern = re.escape(word[:2]) + "[a-z]"
    cut = re.search(pattern, full)
    assert cut is not None
    trimmed = greedy_completion(server, prompt, stop_regex=pattern)
    assert trimmed["text"] == full[: cut.start()] and trimmed["finish_reason"] == "stop"
    kept = greedy_completion(server, prompt, stop_regex=[pattern], include_stop_str_in_output=True)
    assert kept["text"] == full[: cut.end()]
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop_regex": pattern,
          "no_stop_trim": True}  # fmt: skip
    events = list(
        sse_events(server.url + "/generate", {"text": prompt, "sampling_params": sp,
                                              "stream": True}, server.headers())
    )  # fmt: skip
    assert events[-1]["text"] == full[: cut.end()]
    stop = full[cut.start() : cut.end()]
    assert (
        greedy_completion(server, prompt, stop=stop, no_stop_trim=True)["text"] == full[: cut.end()]
    )


def test_continuous_usage_and_chat_options(server):
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True, "include_usage": True},
        "model": "unknown",
        "separate_reasoning": True,
        "include_reasoning": True,
    }
    events = list(sse_events(server.url + "/v1/chat/completions", body, server.headers()))
    assert all(e["usage"] is not None for e in events)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] <= 5 and events[-1]["choices"] == []
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    out = ok(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 3,
                                              "continue_final_message": True})  # fmt: skip
    assert out["choices"][0]["message"]["role"] == "assistant"
    status, out = server.post("/v1/chat/completions", {**body, "return_hidden_states": True})
    assert status == 400 and out["error"]["param"] == "return_hidden_states"


def test_unknown_names_are_ignored_with_one_warning(server):
    body = {"prompt": "hi", "max_tokens": 1, "zz_unknown_option": {"a": 1}}
    for _ in range(3):
        ok(server, "/v1/completions", body)
    log = server.output(None)
    assert log.count("ignoring field zz_unknown_option of /v1/completions") == 1, log[-2000:]


def test_strict_fields_refuses_unknown_names(tiny_model_dir):
    with serving(tiny_model_dir, "--strict-fields") as srv:
        status, out = srv.post("/v1/completions", {"prompt": "hi", "zz_unknown_option": 1})
        assert status == 400 and out["error"]["param"] == "zz_unknown_option"
        status, _ = srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 1,
                                                 "no_stop_trim": False})  # fmt: skip
        assert status == 200
