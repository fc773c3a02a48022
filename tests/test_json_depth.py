"""Deeply nested JSON from clients: refused with a ValueError / 400 naming the field, never a
RecursionError (a 500 in the server)."""

from __future__ import annotations

import json

import pytest

from radixrt.json_depth import (
    MAX_JSON_DEPTH,
    text_depth_exceeds,
    too_deep_path,
    value_depth_exceeds,
)
from radixrt.sampling import SamplingParams
from radixrt.server.protocol import ApiError, ModelInfo
from radixrt.server.validate import parse_chat, parse_generate

MODEL = ModelInfo("m", 1000, 512)


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def test_text_depth_counts_containers_not_brackets_in_strings():
    assert not text_depth_exceeds(nested(MAX_JSON_DEPTH))
    assert text_depth_exceeds(nested(MAX_JSON_DEPTH + 1))
    assert text_depth_exceeds("[" * 5, limit=4)  # unbalanced input counts as well
    hidden = json.dumps({"a": "[" * 1000, "b": '\\"[{' * 100})
    assert not text_depth_exceeds(hidden, limit=1)
    assert text_depth_exceeds(json.dumps({"a": ["[["]}), limit=1)


def test_value_depth_is_iterative():
    v: object = 1
    for _ in range(100_000):  # far past the recursion limit
        v = [v]
    assert value_depth_exceeds(v)
    assert not value_depth_exceeds({"a": [{"b": 1}]}, limit=3)
    assert value_depth_exceeds({"a": [{"b": []}]}, limit=3)


def test_too_deep_path_names_the_field():
    body = '{"x": [1, {"y": 2}], "sampling_params": {"n": 1, "json_schema": ' + nested(5000) + "}}"
    assert too_deep_path(body) == "sampling_params.json_schema"
    assert too_deep_path('{"m": [0, 1, ' + "[" * 200 + "]" * 200 + "]}") == "m[2]"
    assert too_deep_path(nested(10)) is None
    assert too_deep_path("[" * 5000) == "[0][0]"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 600, 1000, 20_000])
def test_deep_json_schema_is_a_value_error(depth):
    with pytest.raises(ValueError, match="json_schema.*nested at most"):
        SamplingParams(json_schema=nested(depth)[: 64 * 1024])
    if depth < 900:  # a dict as deep (json.loads itself would fail deeper)
        with pytest.raises(ValueError, match="json_schema.*nested at most"):
            SamplingParams(json_schema=json.loads(nested(depth)))
    assert SamplingParams(json_schema=nested(MAX_JSON_DEPTH)).json_schema


@pytest.mark.parametrize("depth", [300, 1000, 50_000])
@pytest.mark.parametrize("as_string", [True, False])
def test_deep_json_schema_in_a_body_is_400_naming_the_field(depth, as_string):
    schema = json.dumps(nested(depth)) if as_string else nested(depth)
    raw = '{"text": "hi", "sampling_params": {"json_schema": ' + schema + "}}"
    with pytest.raises(ApiError) as e:
        parse_generate(raw.encode(), MODEL)
    assert e.value.status == 400 and e.value.param == "sampling_params.json_schema", e.value
    chat = (
        '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": '
        '{"type": "json_schema", "json_schema": {"name": "a", "schema": ' + nested(depth) + "}}}"
    )
    with pytest.raises(ApiError) as e:
        parse_chat(chat.encode(), MODEL, lambda messages: "hi")
    assert e.value.status == 400 and "json_schema" in e.value.param, e.value
