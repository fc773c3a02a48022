"""Tool calling through the official `openai` client against `radixrt serve` on the tiny
model: required and named calls valid by construction (streamed and not), the call
history rendered by the chat template, auto, and bad tool fields."""

from __future__ import annotations

import json

import pytest
from server_utils import http_call, serving

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "now", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _chat(client, **kw):
    kw.setdefault("max_tokens", 300)
    kw.setdefault("tools", TOOLS)
    return client.chat.completions.create(model="default", messages=USER, **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_calls_are_valid_by_construction(client, seed):
    out = _chat(
        client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    _valid(call.function.name, call.function.arguments)


def test_parallel_calls_each_valid(client):
    """The tiny model keeps calling until its budget ends: every call returned matches its
    schema (a last call that the budget cut is not returned)."""
    choice = _chat(client, tool_choice="required", temperature=1.0, seed=4).choices[0]
    calls = choice.message.tool_calls
    assert len(calls) > 1 and len({c.id for c in calls}) == len(calls)
    for c in calls:
        _valid(c.function.name, c.function.arguments)


def _calls_and_reason(client, stream: bool, **kw) -> tuple[list[tuple[str, str]], str]:
    """((name, arguments) of each call, finish_reason), from a whole or a streamed answer."""
    if not stream:
        choice = _chat(client, **kw).choices[0]
        calls = choice.message.tool_calls or []
        return [(c.function.name, c.function.arguments) for c in calls], choice.finish_reason
    parts: dict[int, list[str]] = {}
    reason = None
    for chunk in _chat(client, stream=True, **kw):
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            for tc in ch.delta.tool_calls or []:
                if tc.id is not None:
                    parts[tc.index] = [tc.function.name, ""]
                parts[tc.index][1] += tc.function.arguments or ""
    return [(parts[i][0], parts[i][1]) for i in sorted(parts)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_calls_end_at_max_tool_calls(client, stream):
    """Greedy, the tiny model repeats its call (~49 tokens each) until max_tokens; with
    max_tool_calls 2 the grammar ends the output after the second call, as tool_calls."""
    kw = dict(tool_choice="required", temperature=0, max_tokens=200)
    calls, reason = _calls_and_reason(client, stream, **kw)
    assert reason == "length" and len(calls) > 2, (reason, calls)  # the default bound: 16
    calls, reason = _calls_and_reason(client, stream, extra_body={"max_tool_calls": 2}, **kw)
    assert reason == "tool_calls" and len(calls) == 2, (reason, calls)
    for name, arguments in calls:
        _valid(name, arguments)


def test_one_call_ends_within_64_tokens(client):
    """Greedy, whole and streamed (the all-enum schema: WEATHER's free 12-character city
    alone can take 12 of the tiny tokenizer's tokens)."""
    kw = dict(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64)
    for stream in (False, True):
        calls, reason = _calls_and_reason(client, stream, tools=ENUM_TOOLS, **kw)
        assert reason == "tool_calls" and len(calls) == 1, (reason, calls)
        jsonschema.validate(json.loads(calls[0][1]), ENUMS)


def test_max_tool_calls_out_of_range_is_400(server):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tool_calls": 0}
    status, out = http_call(server.url + "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "max_tool_calls", out


def test_named_call_without_parallel_calls(client):
    out = _chat(
        client,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        temperature=0.8,
        seed=3,
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _valid("get_time", call.function.arguments)
    assert out.choices[0].finish_reason == "tool_calls"


def test_streamed_calls_equal_the_whole_response(client):
    kw = dict(tool_choice="required", temperature=1.0, seed=5, max_tokens=200)
    whole = _chat(client, **kw).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in _chat(client, stream=True, **kw):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for tc in choice.delta.tool_calls or []:
                if tc.id is not None:  # the first delta of a call: id, type, name
                    assert tc.index not in calls and tc.type == "function"
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    assert reasons[-1] == whole.finish_reason
    assert sorted(calls) == list(range(len(calls)))
    got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # a stream has sent a call's start before the budget cuts it; the whole response drops it
    assert got == want or (whole.finish_reason == "length" and got[:-1] == want), (got, want)
    for name, arguments in want:
        _valid(name, arguments)


def test_round_trip_with_call_history(client, server):
    first = _chat(client, tool_choice="required", parallel_tool_calls=False, temperature=0)
    message = first.choices[0].message
    history = [*USER, message.model_dump(exclude_none=True)]
    for c in message.tool_calls:
        history.append({"role": "tool", "tool_call_id": c.id, "content": "Sunny, 21 C"})
    out = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, max_tokens=16, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the history is in the prompt as the chat template renders it
    _, prompt = http_call(server.url + "/tokenize", {"messages": history, "tools": TOOLS})
    _, text = http_call(server.url + "/detokenize", {"tokens": prompt["tokens"]})
    text = text["prompt"]
    assert '<tool_call>\n{"name": "' + message.tool_calls[0].function.name in text
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text
    assert '"name": "get_time", "description": "now"' in text
    assert out.usage.prompt_tokens == prompt["count"]


def test_auto_and_none(client):
    auto = _chat(client, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for c in auto.choices[0].message.tool_calls or []:
        _valid(c.function.name, c.function.arguments)  # constrained once started
    none = _chat(client, tool_choice="none", temperature=0)
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "change, param",
    [
        ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[1].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "strin"}}}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools[0].function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}}}],
          "tool_choice": "required"}, "tools"),  # compiles in the scheduler: names tools
    ],
)  # fmt: skip
def test_bad_tool_fields_name_the_field(server, change, param):
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 4, **change}
    if body["tools"] is None:
        del body["tools"]
    status, out = http_call(server.url + "/v1/chat/completions", body)
    assert status == 400, out
    assert out["error"]["param"] == param, out


def test_bad_history_arguments(server):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    body = {"messages": [*USER, {"role": "assistant", "tool_calls": [call]}], "max_tokens": 2}
    status, out = http_call(server.url + "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_langchain_bind_tools(server):
    """langchain-openai's bind_tools (the `test` extra installs it)."""
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import BaseModel, Field

    class get_time(BaseModel):  # noqa: N801 (the tool's name)
        """The time in a three-letter time zone."""

        # bounded: a free string lets the tiny model write until max_tokens cuts the call
        tz: str = Field(pattern="^[A-Z]{3}$")

    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="default",
                        temperature=0, max_tokens=200, max_retries=0)  # fmt: skip
    bound = llm.bind_tools([get_time], tool_choice="get_time")
    messages = [HumanMessage("What time is it in CET?")]
    ai = bound.invoke(messages)
    (call,) = ai.tool_calls
    assert call["name"] == "get_time" and isinstance(call["args"].get("tz"), str)
    streamed = None
    for chunk in bound.stream(messages):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["get_time"]
    follow = llm.bind_tools([get_time]).invoke(
        [*messages, ai, ToolMessage("12:00", tool_call_id=call["id"])]
    )
    assert isinstance(follow.content, str)


ENUMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Paris", "Rome"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ENUM_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": ENUMS}}]


def _in_64(client, **kw):
    return client.chat.completions.create(
        model="default", messages=USER, tools=ENUM_TOOLS, max_tokens=64, parallel_tool_calls=False,
        **kw,
    )  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_call_fits_64_tokens(client, seed):
    """The call's fixed text is appended as the tokenizer writes it and its JSON is compact:
    sampled hot, the tiny model's call of an all-enum schema (58 tokens as its tokenizer
    writes it) ends within 64 tokens."""
    out = _in_64(client, tool_choice="required", temperature=1.0, seed=seed)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and out.usage.completion_tokens <= 64, out
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), ENUMS)


def test_named_and_streamed_calls_fit_64_tokens(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = _in_64(client, tool_choice=named, temperature=1.0, seed=7)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), ENUMS)
    arguments, reasons = "", []
    for chunk in _in_64(client, tool_choice="required", temperature=1.0, seed=8, stream=True):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for tc in c.delta.tool_calls or []:
                arguments += tc.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    jsonschema.validate(json.loads(arguments), ENUMS)
