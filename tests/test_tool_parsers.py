"""Tool-call formats: whole-text parses of transcripts in each model family's format, and
streaming (the deltas of any chunking add up to the whole-text parse)."""

from __future__ import annotations

import json
import random

import pytest

from radixrt.server.tools import create_tool_format, default_tool_parser
from radixrt.server.tools.stream import ToolStream

WEATHER = '{"city": "Paris \\"centre\\" {x}", "unit": "celsius", "days": [1, 2.5e1, -3]}'

# (format, output text, expected content, expected [(name, arguments text)])
TRANSCRIPTS = [
    ("hermes", "The answer is 4.", "The answer is 4.", []),
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + "}\n"
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
        "Let me look.\n",  # the blank between calls separates them
        [("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')],
    ),
    (  # Qwen3 writes arguments first at times; a call without arguments gets {}
        "hermes",
        '<tool_call>{"arguments": {"q": 1}, "name": "search"}</tool_call><tool_call>'
        '{"name": "now"}</tool_call>',
        "",
        [("search", '{"q": 1}'), ("now", "{}")],
    ),
    (
        "hermes",
        "a <tool_call> b </tool_call> <tool_ c",
        "a <tool_call> b </tool_call> <tool_ c",
        [],
    ),
    (  # blanks after a call separate; other text after it is content
        "hermes",
        '<tool_call>{"name": "now"}</tool_call>\n \n<tool_c and then text',
        "\n \n<tool_c and then text",
        [("now", "{}")],
    ),
    (  # cut by the token budget inside the arguments
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "}',
        "",
        [("f", '{"a": [1, {"b": "}')],
    ),
    ("llama3_json", "Paris is in France.", "Paris is in France.", []),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER + "}",
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
        '{"city": "Rome"}}',
        "",
        [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')],
    ),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    (
        "mistral",
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER + '}, {"name": '
        '"get_time", "arguments": {"tz": "UTC"}}]',
        "Sure.",
        [("get_weather", WEATHER), ("get_time", '{"tz": "UTC"}')],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    ),
    ("mistral", "[TOOL no calls here [", "[TOOL no calls here [", []),
]

TOOL_NAMES = frozenset({"get_weather", "get_time", "search", "now", "f"})


def _stream(fmt, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]], list]:
    stream = ToolStream(fmt)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, names, args, heads = "", {}, {}, []
    for i, piece in enumerate(pieces):
        d = stream.feed(piece, final=i == len(pieces) - 1)
        content += d.content
        for tc in d.tool_calls:
            k = tc["index"]
            if "id" in tc:
                assert k not in names and tc["type"] == "function"
                assert tc["function"]["arguments"] == ""
                names[k], args[k] = tc["function"]["name"], ""
                heads.append(tc)
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                args[k] += tc["function"]["arguments"]
    return content, [(names[k], args[k]) for k in sorted(names)], heads


@pytest.mark.parametrize("case", range(len(TRANSCRIPTS)))
def test_whole_text_parse(case):
    name, text, content, calls = TRANSCRIPTS[case]
    scan = create_tool_format(name, TOOL_NAMES).parse(text)
    assert scan.content == content
    assert [(c.name, c.arguments) for c in scan.calls] == calls
    for _, arguments in calls:
        if arguments.endswith("}") and arguments.count("{") == arguments.count("}"):
            json.loads(arguments)


@pytest.mark.parametrize("case", range(len(TRANSCRIPTS)))
def test_streaming_equals_whole_text_over_random_chunkings(case):
    name, text, content, calls = TRANSCRIPTS[case]
    rng = random.Random(case)
    for _ in range(200):
        fmt = create_tool_format(name, TOOL_NAMES)
        got_content, got_calls, heads = _stream(fmt, text, rng)
        assert (got_content, got_calls) == (content, calls)
        assert [h["index"] for h in heads] == list(range(len(calls)))
        assert len({h["id"] for h in heads}) == len(heads)


def test_character_by_character_prefix_scans_only_grow():
    for name, text, _, _ in TRANSCRIPTS:
        fmt = create_tool_format(name, TOOL_NAMES)
        before = fmt.scan("", False)
        for i in range(1, len(text) + 1):
            now = fmt.scan(text[:i], i == len(text))
            assert now.content.startswith(before.content), (name, text[:i])
            for a, b in zip(before.calls, now.calls):
                assert a.name == b.name and b.arguments.startswith(a.arguments), (name, i)
            assert len(now.calls) >= len(before.calls)
            before = now


def test_default_parser_from_chat_template():
    assert default_tool_parser("{{ '<tool_call>' }}") == "hermes"
    assert default_tool_parser("{{- '<|python_tag|>' }} ipython") == "llama3_json"
    assert default_tool_parser("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert default_tool_parser(None) == "hermes"
    with pytest.raises(ValueError, match="allowed: hermes, llama3_json, mistral"):
        create_tool_format("pythonic")


def test_serve_config_checks_the_parser():
    from radixrt.server.launch import ServeConfig

    assert ServeConfig(model="m", tool_call_parser="mistral").tool_call_parser == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServeConfig(model="m", tool_call_parser="pythonic")
