"""Tool calling in programs: the tools a program offers are rendered by the chat template
(`tools(...)` before the first role), a `gen` with `tool_choice` is constrained to calls in
the model's format (radixrt.server.tools) and its calls are read back from the text.

    s += tools([{"type": "function", "function": {"name": "lookup", "parameters": {...}}}])
    s += system("...") + user(question)
    s += assistant(gen("step", tool_choice="required"))
    for call in s.tool_calls("step"):
        s += tool_result(call["id"], run(call["name"], call["arguments"]))
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from radixrt.sampling import SamplingParams
from radixrt.server.protocol import ApiError
from radixrt.server.tools import Tool, ToolFormat, create_tool_format, default_tool_parser
from radixrt.server.tools.request import DEFAULT_MAX_TOOL_CALLS, ToolRequest
from radixrt.server.tools.schema_check import check_schema
from radixrt.server.tools.stream import parse_calls


def normalized_tools(defs: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """OpenAI-style tool definitions (a bare {"name", "parameters"} is wrapped); ValueError
    for a definition without a name or with a parameters value that is no object schema."""
    out = []
    for i, d in enumerate(defs):
        fn = d.get("function", d) if isinstance(d, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        try:
            check_schema(params, f"tools[{i}].function.parameters")
        except ApiError as e:  # the server's message, as the DSL's ValueError
            raise ValueError(e.message) from None
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return tuple(out)


def constrained(
    params: SamplingParams,
    defs: tuple[dict[str, Any], ...],
    choice: str,
    parallel: bool,
    chat_template: str | None,
) -> tuple[SamplingParams, ToolFormat]:
    """`params` with the structural tag of calls of `defs` (choice "auto", "required" or a
    tool's name) in the format of `chat_template`'s model, and that format."""
    tools = tuple(
        Tool(d["function"]["name"], d["function"]["parameters"], d["function"].get("description"))
        for d in defs
    )
    names = {t.name for t in tools}
    if choice not in ("auto", "required") and choice not in names:
        raise ValueError(f"tool_choice {choice!r}: allowed: auto, required, {', '.join(names)}")
    fmt = create_tool_format(default_tool_parser(chat_template), frozenset(names))
    forced = None if choice in ("auto", "required") else choice
    kind = "function" if forced else choice
    max_calls = DEFAULT_MAX_TOOL_CALLS if parallel and forced is None else 1  # named: one call
    request = ToolRequest(tools, defs, kind, forced, max_calls, fmt)
    tag = request.structural_tag()
    if tag is not None and any(getattr(params, f) for f in ("regex", "json_schema", "grammar")):
        raise ValueError("a gen with tool_choice cannot also have regex or json_schema")
    extra: dict[str, Any] = {"structural_tag": tag}
    if fmt.keeps_special_tokens:
        extra["skip_special_tokens"] = False
    return dataclasses.replace(params, **extra), fmt


def read_calls(fmt: ToolFormat, text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) of a generated text; a call is {"id", "name", "arguments"} with the
    arguments decoded (their text when it is not JSON)."""
    content, calls = parse_calls(fmt, text)
    out = []
    for c in calls:
        try:
            args: Any = json.loads(c.arguments)
        except ValueError:
            args = c.arguments
        out.append({"id": c.id, "name": c.name, "arguments": args})
    return content, out
