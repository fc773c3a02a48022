"""`radixrt serve` with no --model serves SmolLM2 (the real model), checked through the official
`openai` client: it names Paris, streamed text equals the text returned at once, stop strings,
n = 2, cached prompt tokens growing over a 5-turn chat, an answer under a JSON schema that
parses and validates, and a `required` tool call whose arguments validate."""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_utils import serving
from smollm2_model import smollm2_gguf  # noqa: F401  (fixture)
from smollm2_prompts import CHATS

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(smollm2_gguf):  # noqa: F811  (fetched: the server finds it cached)
    with serving(None, "--num-kv-blocks", "512") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)


def _ask(client, messages, **kw):
    kw = {"temperature": 0, "max_tokens": 32, **kw}
    return client.chat.completions.create(model="default", messages=messages, **kw)


def test_default_model_is_smollm2_and_names_paris(server, client):
    assert "SmolLM2-135M-Instruct" in server.output()
    out = _ask(client, CHATS[0])
    assert "Paris" in out.choices[0].message.content


def test_streamed_text_equals_the_text_returned_at_once(client):
    for chat in CHATS[19:27]:  # non-ASCII, multi-byte characters split across tokens
        whole = _ask(client, chat).choices[0].message.content
        parts = [
            c.choices[0].delta.content or "" for c in _ask(client, chat, stream=True) if c.choices
        ]
        assert "".join(parts) == whole, chat


def test_stop_string_cuts_the_answer(client):
    chat = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = _ask(client, chat).choices[0].message.content
    assert "5" in full  # greedy: the same text every run
    out = _ask(client, chat, stop=["5"]).choices[0]
    assert out.finish_reason == "stop" and out.message.content == full[: full.index("5")]


def test_n_2_gives_two_choices(client):
    out = _ask(client, CHATS[2], n=2, temperature=0.8, seed=7, max_tokens=16)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.message.content for c in out.choices)


def test_cached_tokens_grow_over_a_five_turn_chat(client):
    messages = [{"role": "system", "content": "You are a friendly assistant."}]
    cached = []
    for question in ("Hi!", "What is 2 + 2?", "And 3 + 3?", "Name a fruit.", "Thanks, bye!"):
        messages.append({"role": "user", "content": question})
        out = _ask(client, messages, max_tokens=16)
        details = out.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
    assert all(b > a for a, b in zip(cached, cached[1:])), cached


def test_json_schema_answer_parses_and_validates(client):
    chat = [{"role": "user", "content": "Describe a person named Ada, aged 36, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = _ask(client, chat, response_format=fmt, max_tokens=64).choices[0]
    jsonschema.validate(json.loads(out.message.content), PERSON)


def test_required_tool_call_validates_against_its_schema(client):
    chat = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = _ask(client, chat, tools=[WEATHER], tool_choice="required", max_tokens=64).choices[0]
    calls = out.message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
