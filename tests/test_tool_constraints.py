"""The structural tags of tool calls: in each format, the grammar accepts the calls the
format's parser reads (arguments matching the schema) and refuses arguments that do not
match, names that are not offered, a second call when parallel calls are off, and text
instead of a call when a call is required."""

from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

from radixrt.server.tools import Tool, create_tool_format  # noqa: E402

WEATHER = Tool(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
NOW = Tool("now", {})
GOOD = ('{"city": "Paris", "days": 3}', "{}")
BAD = '{"city": "Paris", "days": 9}'

# format -> (one call of WEATHER with arguments {0}, two calls {0} and NOW's {1}, text + call)
TEXTS = {
    "hermes": (
        '<tool_call>\n{{"name": "get_weather", "arguments": {0}}}\n</tool_call>',
        '<tool_call>\n{{"name": "get_weather", "arguments": {0}}}\n</tool_call>\n'
        '<tool_call>\n{{"name": "now", "arguments": {1}}}\n</tool_call>',
        'Let me see. <tool_call>\n{{"name": "get_weather", "arguments": {0}}}\n</tool_call>',
    ),
    "llama3_json": (
        '{{"name": "get_weather", "parameters": {0}}}',
        '{{"name": "get_weather", "parameters": {0}}}; {{"name": "now", "parameters": {1}}}',
        None,  # calls only at the start: auto is not constrained
    ),
    "mistral": (
        '[TOOL_CALLS][{{"name": "get_weather", "arguments": {0}}}]',
        '[TOOL_CALLS][{{"name": "get_weather", "arguments": {0}}}, {{"name": "now", '
        '"arguments": {1}}}]',
        'Let me see. [TOOL_CALLS][{{"name": "get_weather", "arguments": {0}}}]',
    ),
}


def _grammar(fmt, tools, **kw):
    tag = {"type": "structural_tag", "format": fmt.calls_format(tools, **kw)}
    return xgr.Grammar.from_structural_tag(json.dumps(tag))


def _accepts(grammar, text: str) -> bool:
    return _is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_required_and_named_calls(name):
    fmt = create_tool_format(name)
    one, two, _ = TEXTS[name]
    required = _grammar(fmt, [WEATHER, NOW], at_least_one=True, max_calls=64)
    assert _accepts(required, one.format(*GOOD))
    assert _accepts(required, two.format(*GOOD))
    assert not _accepts(required, one.format(BAD, "{}"))
    assert not _accepts(required, one.format(*GOOD).replace("get_weather", "get_time"))
    assert not _accepts(required, "Sure, here you go.")
    assert not _accepts(required, "")
    single = _grammar(fmt, [WEATHER, NOW], at_least_one=True, max_calls=1)
    assert _accepts(single, one.format(*GOOD)) and not _accepts(single, two.format(*GOOD))
    named = _grammar(fmt, [NOW], at_least_one=True, max_calls=1)
    assert not _accepts(named, one.format(*GOOD))
    # what the grammar accepts, the parser reads back
    scan = fmt.parse(two.format(*GOOD))
    assert [(c.name, json.loads(c.arguments)) for c in scan.calls] == [
        ("get_weather", json.loads(GOOD[0])),
        ("now", {}),
    ]


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_auto_constrains_a_started_call(name):
    fmt = create_tool_format(name)
    _, _, mixed = TEXTS[name]
    auto = _grammar(fmt, [WEATHER, NOW], at_least_one=False, max_calls=64)
    assert _accepts(auto, "No call needed: 4.")
    assert _accepts(auto, mixed.format(*GOOD))
    assert not _accepts(auto, mixed.format(BAD, "{}"))
    scan = fmt.parse(mixed.format(*GOOD))
    assert scan.content.strip() == "Let me see." and scan.calls[0].name == "get_weather"


def test_llama3_has_no_constrained_auto():
    with pytest.raises(ValueError, match="no constrained auto"):
        create_tool_format("llama3_json").calls_format([NOW], at_least_one=False, max_calls=64)


def _spec(parser: str, **fields):
    from radixrt.server.protocol import ModelInfo
    from radixrt.server.validate import parse_chat

    seen = {}

    def render(messages, options):
        seen["messages"], seen["options"] = messages, options
        return "prompt"

    body = {"messages": [{"role": "user", "content": "q"}], **fields}
    model = ModelInfo("/m", vocab_size=2048, max_model_len=2048)
    return parse_chat(json.dumps(body).encode(), model, render, tool_parser=parser), seen


TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_parse_chat_puts_the_constraint_on_the_request(parser):
    spec, seen = _spec(parser, tools=[TOOL], tool_choice="required")
    assert spec.grammar_param == "tools" and spec.sampling.structural_tag
    assert spec.params(8).structural_tag == spec.sampling.structural_tag
    assert seen["options"].tools == [{"type": "function", "function": {
        "name": "now", "description": "", "parameters": {"type": "object"}}}]  # fmt: skip
    assert spec.sampling.skip_special_tokens is (parser != "mistral")
    auto, _ = _spec(parser, tools=[TOOL])
    assert (auto.sampling.structural_tag is not None) is (parser != "llama3_json")
    none, _ = _spec(parser, tools=[TOOL], tool_choice="none")
    assert none.sampling.structural_tag is None and none.tools.fmt is None
    with_format, _ = _spec(parser, tools=[TOOL], response_format={"type": "json_object"})
    assert with_format.sampling.structural_tag is None  # auto yields to response_format


def test_call_history_reaches_the_template():
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    _, seen = _spec("hermes", messages=messages)
    assert seen["messages"][1]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": {"a": 1}}}
    ]
    assert seen["messages"][2] == {"role": "tool", "content": "r", "tool_call_id": "c1"}


def test_auto_leaves_text_answers_alone_in_a_mixed_batch(make_engine, tiny_model_dir):
    """Greedy text answers are the same with auto's constraint as without it, in one batch
    with required calls (which are valid); integrity holds after (make_engine)."""
    from transformers import AutoTokenizer

    from radixrt import SamplingParams

    engine = make_engine()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    schema = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 5}},
              "required": ["tz"], "additionalProperties": False}  # fmt: skip
    tool = Tool("get_time", schema)
    defs = [{"type": "function", "function": {"name": "get_time", "parameters": schema}}]
    fmt = create_tool_format("hermes")

    def tag(**kw):
        return json.dumps({"type": "structural_tag", "format": fmt.calls_format([tool], **kw)})

    questions = ["What is the capital of France?", "Tell me a story.", "What time is it?"]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tools=defs, tokenize=False,
                                add_generation_prompt=True)
        for q in questions
    ]  # fmt: skip
    plain = SamplingParams(max_tokens=48, temperature=0)
    auto_tag = tag(at_least_one=False, max_calls=64)
    auto = SamplingParams(max_tokens=48, temperature=0, structural_tag=auto_tag)
    required_tag = tag(at_least_one=True, max_calls=1)
    required = SamplingParams(max_tokens=160, temperature=0.8, seed=1, structural_tag=required_tag)
    outs = engine.generate(prompts * 3, [plain] * 3 + [auto] * 3 + [required] * 3)
    assert [o.text for o in outs[:3]] == [o.text for o in outs[3:6]]
    for o in outs[6:]:
        (call,) = fmt.parse(o.text).calls
        assert call.name == "get_time" and set(json.loads(call.arguments)) == {"tz"}
    engine.check_integrity()


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_required_calls_end_after_max_calls(name):
    """Parallel calls stop at `max_calls`: the output may end after each call and must end
    after the last one allowed."""
    fmt = create_tool_format(name)
    one, two, _ = TEXTS[name]
    two_calls = two.format(*GOOD)
    two_max = _grammar(fmt, [WEATHER, NOW], at_least_one=True, max_calls=2)
    assert _accepts(two_max, one.format(*GOOD)) and _accepts(two_max, two_calls)
    sep = {"hermes": "\n", "llama3_json": "; ", "mistral": ", "}[name]
    call = one.format(*GOOD)
    if name == "mistral":  # one bracket around the calls: add a third inside it
        call = call.removeprefix("[TOOL_CALLS][").removesuffix("]")
        three = two_calls[:-1] + sep + call + "]"
    else:
        three = two_calls + sep + call
    assert not _accepts(two_max, three)
    assert _accepts(_grammar(fmt, [WEATHER, NOW], at_least_one=True, max_calls=3), three)
