"""Every JSON-schema keyword a tool's parameters (or a response_format schema) may hold is
enforced by the grammar or refused with a 400 naming where it is; a call that `max_tokens`
cut is never returned as a call."""

from __future__ import annotations

import json

import pytest

from radixrt.grammar.json_schema_support import check_json_schema
from radixrt.server.protocol import ApiError
from radixrt.server.tools.hermes import HermesFormat
from radixrt.server.tools.output import chat_message
from radixrt.server.tools.request import DEFAULT_MAX_TOOL_CALLS, ToolRequest
from radixrt.server.tools.schema_check import check_schema

PARAM = "tools[0].function.parameters"
INT = {"type": "integer"}


def obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


# the keywords a trial found unenforced, each in a tool's parameters, and where it is
REFUSED = [
    (obj(x={"type": "array", "items": INT, "uniqueItems": True}), "/properties/x/uniqueItems"),
    (obj(x={"oneOf": [{"type": "number"}, INT]}), "/properties/x/oneOf"),
    (obj(x={"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}),
     "/properties/x/oneOf"),
    (obj(x={"type": "array", "items": INT, "contains": {"const": 3}}), "/properties/x/contains"),
    (obj(x={"type": "object", "if": obj(a=INT), "then": obj(b=INT)}), "/properties/x/if"),
    (obj(x={"type": "object", "properties": {"a": INT, "b": INT},
            "dependentRequired": {"a": ["b"]}}), "/properties/x/dependentRequired"),
    (obj(x={"allOf": [INT, {"minimum": 5, "maximum": 6}]}), "/properties/x/allOf"),
    (obj(x={"type": "object", "additionalProperties": INT, "minProperties": 2}),
     "/properties/x/minProperties"),
]  # fmt: skip


@pytest.mark.parametrize("schema, where", REFUSED)
def test_unenforced_keywords_in_tool_parameters_are_400(schema, where):
    with pytest.raises(ApiError) as e:
        check_schema(schema, PARAM)
    assert e.value.param == PARAM and f" at {where}:" in e.value.message, e.value.message
    with pytest.raises(ValueError, match=f" at {where}:"):
        check_json_schema(schema)  # response_format's schemas: the same rule


ACCEPTED = [
    obj(x={"oneOf": [{"type": "string"}, INT]}),
    obj(x={"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]}),
    obj(x={"oneOf": [obj(kind={"const": "a"}, v=INT), obj(kind={"const": "b"}, w=INT)]}),
    obj(x={"allOf": [{"type": "integer", "minimum": 5, "maximum": 6}]}),
    obj(x={"type": "object", "properties": {"a": INT, "b": INT}, "minProperties": 2}),
    obj(x={"type": "array", "items": INT, "uniqueItems": False}),
]


@pytest.mark.parametrize("schema", ACCEPTED)
def test_enforceable_keywords_are_accepted(schema):
    check_schema(schema, PARAM)


def _tools(parallel: bool = True) -> ToolRequest:
    fmt = HermesFormat()
    return ToolRequest((), (), "required", None, DEFAULT_MAX_TOOL_CALLS if parallel else 1, fmt)


def test_a_call_cut_by_max_tokens_is_not_returned():
    whole = '<tool_call>\n{"name": "f", "arguments": {"tz": "UTC"}}\n</tool_call>'
    cut = '\n<tool_call>\n{"name": "f", "arguments": {"tz"\n: "'
    message, reason = chat_message(whole + cut, "length", _tools())
    assert reason == "length"
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"tz": "UTC"}
    message, reason = chat_message(cut.lstrip(), "length", _tools())
    assert reason == "length" and "tool_calls" not in message
    message, reason = chat_message(whole, "stop", _tools())
    assert reason == "tool_calls" and len(message["tool_calls"]) == 1
