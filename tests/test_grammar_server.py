"""Structured output through the server: /generate regex / json_schema / ebnf, OpenAI
response_format on both routes, and 400s for bad constraints (types and sizes from the front,
compile errors from the scheduler process)."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
from server_utils import serving, sse_events

from radixrt.frontend import EngineBackend, RuntimeEndpoint, function, gen

pytest.importorskip("xgrammar")

DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["color", "tags"],
}


COMPILE_LIMIT_S = 5.0  # the server's grammar compile time limit (every other compile: < 1 s)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir, "--grammar-compile-timeout-s", str(COMPILE_LIMIT_S)) as srv:
        # the compile workers start with the scheduler but may still be loading: a first
        # constrained request waits for them (on a loaded machine, longer than a test call)
        body = {"text": "x", "sampling_params": {"max_new_tokens": 2, "regex": "[0-9]+"}}
        status, out = srv.post("/generate", body, timeout=600)
        assert status == 200, out
        yield srv


def test_generate_constraints(server):
    sp = {"max_new_tokens": 60, "temperature": 1.0}
    status, out = server.post(
        "/generate", {"text": ["a", "b", "c"], "sampling_params": {**sp, "regex": DATE}}
    )
    assert status == 200, out
    for o in out:
        assert re.fullmatch(DATE, o["text"]) and o["meta_info"]["finish_reason"]["type"] == "stop"
    for schema in (SCHEMA, json.dumps(SCHEMA)):
        status, o = server.post(
            "/generate", {"text": "x", "sampling_params": {**sp, "json_schema": schema}}
        )
        assert status == 200, o
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
    status, o = server.post(
        "/generate", {"text": "x", "sampling_params": {**sp, "ebnf": 'root ::= "yes" | "no"'}}
    )
    assert status == 200 and o["text"] in ("yes", "no"), o


def test_stream_matches_non_stream(server):
    body = {"text": "d", "sampling_params": {"max_new_tokens": 40, "temperature": 0, "regex": DATE}}
    status, full = server.post("/generate", body)
    assert status == 200 and re.fullmatch(DATE, full["text"]), full
    events = list(sse_events(server.url + "/generate", {**body, "stream": True}))
    assert events[-1]["text"] == full["text"]  # SGLang's streams: the text so far
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "stop"


def test_openai_response_format(server):
    for path, body in [
        ("/v1/completions", {"prompt": "JSON:"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
        status, out = server.post(path, {**body, "max_tokens": 80, "response_format": rf})
        assert status == 200, out
        choice = out["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert choice["finish_reason"] == "stop"
        status, out = server.post(
            path,
            {
                **body,
                "max_tokens": 300,
                "temperature": 0,
                "response_format": {"type": "json_object"},
            },
        )
        assert status == 200, out
        choice = out["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert text.startswith("{")
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        ("/generate", {"text": "x", "sampling_params": {"regex": "(ab"}},
         "sampling_params.regex", "invalid regex: "),
        ("/generate", {"text": "x", "stream": True, "sampling_params": {"regex": "(ab"}},
         "sampling_params.regex", "invalid regex: "),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": {"type": "nope"}}},
         "sampling_params.json_schema", "invalid json_schema: "),
        ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= "}},
         "sampling_params.ebnf", "invalid grammar: "),
        ("/v1/completions", {"prompt": "x", "guided_choice": ["\u0000"]}, "guided_choice",
         "invalid regex"),
        # empty languages: a 400, not a 500
        ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= root"}},
         "sampling_params.ebnf", "no output can match"),
        ("/generate", {"text": "x", "sampling_params": {"regex": "[^\\s\\S]"}},
         "sampling_params.regex", "no output can match"),
        ("/generate", {"text": "x", "stream": True, "sampling_params": {"regex": "[^\\s\\S]"}},
         "sampling_params.regex", "no output can match"),
        # over a complexity limit, before compiling
        ("/generate", {"text": "x", "sampling_params": {"regex": "(a|b|c|d)?" * 3000}},
         "sampling_params.regex", "at most 64 are allowed"),
        # keywords structured output cannot enforce
        ("/generate", {"text": "x", "sampling_params": {"json_schema": {
            "type": "object", "properties": {"n": {"type": "integer", "not": {"const": 1}}}}}},
         "sampling_params.json_schema", 'keyword "not" at /properties/n/not'),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema",
         "json_schema": {"name": "t", "schema": {"type": "number", "multipleOf": 0.5}}}},
         "response_format", '"multipleOf" at /multipleOf'),
        ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": "b"}},
         "sampling_params.ebnf", "at most one"),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": "[1"}},
         "sampling_params.json_schema", "not JSON"),
        ("/generate", {"text": "x", "sampling_params": {"regex": 5}}, "sampling_params.regex", ""),
        ("/generate", {"text": "x", "sampling_params": {"regex": "a" * 70000}},
         "sampling_params.regex", "at most"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}},
         "response_format", "invalid response_format"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}},
         "response_format", "schema"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
         "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
         "response_format", "invalid json_schema: "),
    ],
)  # fmt: skip
def test_bad_constraints_are_400(server, path, body, param, message):
    status, out = server.post(path, body)
    assert status == 400, out
    err = out["error"]
    assert message in err["message"], err
    assert err.get("param") == param, err


def test_grammar_cache_counters_and_no_internal_errors_on_metrics(server):
    """Each distinct constraint is a miss, a repeat a hit; bad grammars count no internal
    error."""
    before = _metrics(server)
    body = {"text": "x", "sampling_params": {"max_new_tokens": 30, "regex": "[0-9]{3}-metrics"}}
    for _ in range(2):
        status, out = server.post("/generate", body)
        assert status == 200 and re.fullmatch("[0-9]{3}-metrics", out["text"]), out
    bad = {"text": "x", "sampling_params": {"ebnf": "root ::= root root"}}
    assert server.post("/generate", bad)[0] == 400
    after = _metrics(server)
    assert after["radixrt_grammar_cache_misses"] - before["radixrt_grammar_cache_misses"] == 2
    assert after["radixrt_grammar_cache_hits"] - before["radixrt_grammar_cache_hits"] == 1
    assert after["radixrt_grammar_cache_bytes"] > 0
    assert "radixrt_grammar_cache_evictions" in after
    assert after["radixrt_internal_errors_total"] == 0


def test_other_clients_grammars_compile_during_a_slow_compile_attack(server):
    """Two grammars that would compile for minutes hold both compile slots; another client's
    regex request completes, correct, well before they are stopped at the time limit."""
    slow = "root ::= " + ' ("a" | "b" | "c" | "d")?' * 600
    results: list[tuple[int, dict]] = []

    def attack(i: int) -> None:
        body = {"text": "x", "sampling_params": {"ebnf": f'{slow} "{i}"'}}
        results.append(server.post("/generate", body))

    threads = [threading.Thread(target=attack, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both compiles running
    t0 = time.monotonic()
    regex = DATE + " attack"  # not cached: it must compile
    body = {
        "text": "d",
        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "regex": regex},
    }
    status, out = server.post("/generate", body)
    latency = time.monotonic() - t0
    assert status == 200 and re.fullmatch(regex, out["text"]), out
    assert latency < COMPILE_LIMIT_S, latency  # it did not wait for the slow ones to stop
    for t in threads:
        t.join()
    for status, out in results:
        assert status == 400, out
        assert out["error"]["param"] == "sampling_params.ebnf"
        assert "took longer than" in out["error"]["message"]
    metrics = _metrics(server)
    assert metrics["radixrt_grammar_compile_timeouts"] >= 2
    assert metrics["radixrt_grammar_compile_preemptions"] >= 1


def _metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = server.get("/metrics")
    assert status == 200
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@function
def tool_call(s, question):
    s += "Q: " + question + "\nDate: "
    s += gen("date", regex=DATE, temperature=1.0, max_tokens=20)
    s += "\nCall: "
    s += gen("call", json_schema=SCHEMA, temperature=1.0, max_tokens=60)


def _check_tool_call(state):
    assert re.fullmatch(DATE, state["date"]), state["date"]
    jsonschema.validate(json.loads(state["call"]), SCHEMA)


def test_dsl_gen_constraints_on_both_backends(server, make_engine, tiny_model_dir):
    local = EngineBackend(make_engine())
    remote = RuntimeEndpoint(server.url, model_path=tiny_model_dir)
    try:
        for backend in (local, remote):
            for state in tool_call.run_batch(
                [{"question": q} for q in ("when?", "who?", "what?")], backend=backend
            ):
                _check_tool_call(state)
    finally:
        local.close()
    with pytest.raises(ValueError, match="at most one"):
        gen("x", regex="a", json_schema={"type": "string"})
