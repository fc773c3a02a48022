"""Property: a tool schema built from JSON-schema keywords (those the grammar enforces, and
those it cannot, which a trial found broken) is refused with a 400 naming the tool's
parameters, or every call the tiny model returns, sampled hot, validates against it with
`jsonschema` (a cut call is never returned)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrt import SamplingParams
from radixrt.server.protocol import ApiError
from radixrt.server.schemas import ToolDef
from radixrt.server.tools import create_tool_format
from radixrt.server.tools.output import chat_message
from radixrt.server.tools.request import ToolRequest, checked_tools

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

NAMES = st.sampled_from(["a", "b", "city", "n", "tags", "x_y"])
WORDS = st.text(alphabet="abcxyz", min_size=1, max_size=4)
SMALL = st.integers(-50, 50)


@st.composite
def int_range(draw) -> dict:
    lo = draw(SMALL)
    return {"type": "integer", "minimum": lo, "maximum": lo + draw(st.integers(0, 40))}


@st.composite
def string(draw) -> dict:
    top = draw(st.integers(0, 5))
    out = {"type": "string", "maxLength": top}
    if draw(st.booleans()):
        out["minLength"] = draw(st.integers(0, top))
    return out


LEAVES = st.one_of(
    string(),
    int_range(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(WORDS, min_size=1, max_size=4, unique=True).map(lambda e: {"enum": e}),
    st.one_of(WORDS, SMALL, st.booleans()).map(lambda v: {"const": v}),
)


# keywords the grammar does not enforce: such a schema must be refused
UNENFORCED = st.one_of(
    int_range().map(lambda i: {"type": "array", "items": i, "maxItems": 3, "uniqueItems": True}),
    st.just({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
             "maxItems": 3, "contains": {"const": 3}}),
    st.just({"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                       {"type": "number", "minimum": 0, "maximum": 9}]}),
    st.just({"allOf": [{"type": "integer"}, {"minimum": 5, "maximum": 6}]}),
    st.just({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
             "dependentRequired": {"a": ["b"]}}),
    st.just({"type": "object", "additionalProperties": {"type": "boolean"}, "maxProperties": 3,
             "minProperties": 2}),
)  # fmt: skip


def compound(inner: st.SearchStrategy) -> st.SearchStrategy:
    arrays = st.builds(
        lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                  "maxItems": lo + extra},
        inner, st.integers(0, 2), st.integers(0, 2),
    )  # fmt: skip
    return st.one_of(
        arrays,
        st.tuples(inner, inner).map(lambda ab: {"anyOf": list(ab)}),
        st.tuples(string(), int_range()).map(lambda ab: {"oneOf": list(ab)}),
        inner.map(lambda s: {"allOf": [s]}),
        objects(inner),
    )


def objects(values: st.SearchStrategy) -> st.SearchStrategy:
    @st.composite
    def build(draw) -> dict:
        props = draw(st.dictionaries(NAMES, values, min_size=1, max_size=3))
        required = [k for k in props if draw(st.booleans())]
        out = {"type": "object", "properties": props, "required": required,
               "additionalProperties": False}  # fmt: skip
        if draw(st.booleans()):
            out["minProperties"] = draw(st.integers(0, len(props)))
        return out

    return build()


SCHEMAS = objects(st.recursive(st.one_of(LEAVES, UNENFORCED), compound, max_leaves=4))


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,  # the same schemas on every run
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=SCHEMAS)
def test_every_returned_call_validates(make_engine, schema):
    engine = getattr(test_every_returned_call_validates, "engine", None) or make_engine()
    test_every_returned_call_validates.engine = engine
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    try:
        tools, template = checked_tools([msgspec.convert(tool, ToolDef)])
    except ApiError as e:
        assert e.param == "tools[0].function.parameters" and " at /" in e.message, e.message
        return
    fmt = create_tool_format("hermes", frozenset({"f"}))
    request = ToolRequest(tuple(tools), tuple(template), "required", None, 1, fmt)
    tag = request.structural_tag()
    params = SamplingParams(max_tokens=160, temperature=1.5, seed=0, structural_tag=tag)
    calls = 0
    for out in engine.generate(["Call f."] * 6, params):
        assert out.finish_reason.value in ("stop", "length"), out
        message, reason = chat_message(out.text, out.finish_reason.value, request)
        for call in message.get("tool_calls") or []:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
            calls += 1
        assert reason != "tool_calls" or len(message["tool_calls"]) == 1
    assert calls  # the samples made calls: there was something to validate
