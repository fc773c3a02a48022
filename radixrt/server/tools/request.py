"""A chat request's tools, tool choice and call history: checked (ApiError naming the
field), rendered for the chat template, and turned into the constraint of the output."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from radixrt.sampling import MAX_GRAMMAR_CHARS, SamplingParams
from radixrt.server.protocol import ApiError, checked
from radixrt.server.tools.base import Tool, ToolFormat
from radixrt.server.tools.schema_check import check_schema

CHOICES = ("none", "auto", "required")
MAX_TOOL_CALLS = 128  # `max_tool_calls` at most
# calls in one answer when `max_tool_calls` is absent: a model that repeats its call ends
# there with finish_reason tool_calls instead of running into max_tokens
DEFAULT_MAX_TOOL_CALLS = 16
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's function names


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tool calling."""

    tools: tuple[Tool, ...]  # the offered functions
    template_tools: tuple[dict, ...]  # the same as the chat template takes them (OpenAI's)
    choice: str  # "none" | "auto" | "required" | "function" (a named one)
    forced: str | None  # choice "function": the function's name
    max_calls: int  # calls allowed in the answer (1: parallel_tool_calls false, or a named call)
    fmt: ToolFormat | None  # how the model writes calls; None with choice "none"

    def __post_init__(self) -> None:
        # a bool here (the field was once `parallel`) would silently mean 0 or 1 calls
        if type(self.max_calls) is not int or not 1 <= self.max_calls <= MAX_TOOL_CALLS:
            raise ValueError(f"max_calls: an int in 1..{MAX_TOOL_CALLS}, got {self.max_calls!r}")

    def structural_tag(self) -> str | None:
        """The xgrammar structural tag that constrains the output (JSON), or None: required
        and named calls are calls of the offered tools (or that one) whose arguments match
        their schemas; auto constrains a call once its marker is written, where the format
        has a marker (hermes, mistral)."""
        if self.fmt is None or self.choice == "none":
            return None
        if self.choice == "auto" and not self.fmt.constrains_auto:
            return None
        tools = [t for t in self.tools if self.forced in (None, t.name)]
        fmt = self.fmt.calls_format(tools, at_least_one=self.choice != "auto",
                                    max_calls=self.max_calls)  # fmt: skip
        return json.dumps({"type": "structural_tag", "format": fmt})


def parse_tools(req: Any, fmt_name: str) -> ToolRequest | None:
    """The request's tool fields (`tools`, `tool_choice`, `parallel_tool_calls`,
    `max_tool_calls`) checked; None when it offers no tools."""
    from radixrt.server.tools import create_tool_format

    choice, forced = _choice(req.tool_choice)
    if not req.tools:
        if choice not in ("none", "auto"):
            raise ApiError("tool_choice needs tools", param="tool_choice")
        return None
    tools, template_tools = checked_tools(req.tools)
    if forced is not None and forced not in {t.name for t in tools}:
        raise ApiError(
            f"tool_choice names {forced[:80]!r}, which tools does not offer", "tool_choice"
        )
    names = frozenset(t.name for t in tools)
    fmt = None if choice == "none" else create_tool_format(fmt_name, names)
    if req.parallel_tool_calls is False or forced is not None:  # a named choice: one call
        max_calls = 1
    else:
        max_calls = req.max_tool_calls or DEFAULT_MAX_TOOL_CALLS
    return ToolRequest(tuple(tools), tuple(template_tools), choice, forced, max_calls, fmt)


def checked_tools(defs: list[Any]) -> tuple[list[Tool], list[dict]]:
    """The request's `tools` checked (ApiError naming the field): as Tools, and as the
    chat template takes them."""
    tools: list[Tool] = []
    template_tools: list[dict] = []
    names: set[str] = set()
    for i, t in enumerate(defs):
        p = f"tools[{i}]"
        if t.type != "function":
            raise ApiError(f"{p}.type={t.type!r}: only function tools are supported", f"{p}.type")
        f = t.function
        if not _NAME.fullmatch(f.name):
            raise ApiError(
                f"{p}.function.name={f.name[:80]!r}: a name is 1 to 64 letters, digits, "
                "underscores, dots or dashes",
                f"{p}.function.name",
            )
        if f.name in names:
            raise ApiError(f"{p}.function.name {f.name!r} is offered twice", f"{p}.function.name")
        names.add(f.name)
        params = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        check_schema(params, f"{p}.function.parameters")
        tools.append(Tool(f.name, params, f.description))
        fn = {"name": f.name, "description": f.description or "", "parameters": params}
        template_tools.append({"type": "function", "function": fn})
    return tools, template_tools


def tool_constraint(
    t: ToolRequest, sampling: SamplingParams, grammar: str | None
) -> tuple[SamplingParams, str | None]:
    """`sampling` under the tool constraint, and the field that now sets structured output
    (`grammar`: the one that did before). Auto yields to a response_format; required and
    named calls cannot be combined with one."""
    if t.fmt is not None and t.fmt.keeps_special_tokens:
        sampling = replace(sampling, skip_special_tokens=False)  # the call markers are special
    tag = t.structural_tag()
    if tag is None or (t.choice == "auto" and grammar is not None):
        return sampling, grammar
    if grammar is not None:
        raise ApiError(f"tool_choice {t.choice!r} cannot be combined with {grammar}", "tool_choice")
    if len(tag) > MAX_GRAMMAR_CHARS:
        if t.choice == "auto":
            return sampling, None  # too large to constrain: calls are parsed, not constrained
        raise ApiError(
            f"the tools' schemas make a grammar of {len(tag)} characters; at most "
            f"{MAX_GRAMMAR_CHARS} can be constrained (tool_choice {t.choice!r})",
            "tools",
        )
    return checked(replace, sampling, structural_tag=tag), "tools"


def _choice(value: Any) -> tuple[str, str | None]:
    """(choice, the named function) of `tool_choice` (absent: auto)."""
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in CHOICES:
            raise ApiError(
                f"tool_choice={value[:40]!r}: allowed: none, auto, required, or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if value.get("type", "function") != "function" or not isinstance(name, str):
        raise ApiError(
            'tool_choice must be none, auto, required or {"type": "function", "function": '
            '{"name": ...}}',
            "tool_choice",
        )
    return "function", name


def template_messages(messages: list[dict], raw: list[Any]) -> None:
    """Add the call history of the request's messages `raw` to the template's `messages`
    (in place): an assistant's `tool_calls` (arguments as objects, as templates
    `tojson` them) and a tool message's `tool_call_id`. ApiError naming the field: a call
    needs an `id`, and a tool message answers a call made earlier in the messages."""
    call_ids: set[str] = set()
    for i, (m, r) in enumerate(zip(messages, raw)):
        if r.tool_call_id is not None:
            if r.role == "tool" and r.tool_call_id not in call_ids:
                raise ApiError(
                    f"messages[{i}].tool_call_id={r.tool_call_id[:80]!r} answers no call of "
                    "an earlier assistant message",
                    f"messages[{i}].tool_call_id",
                )
            m["tool_call_id"] = r.tool_call_id
        if not r.tool_calls:
            continue
        if r.role != "assistant":
            raise ApiError(f"messages[{i}].tool_calls: only assistant messages carry calls",
                           f"messages[{i}].tool_calls")  # fmt: skip
        calls = []
        for j, c in enumerate(r.tool_calls):
            if not c.id:
                raise ApiError(
                    f"messages[{i}].tool_calls[{j}].id is missing: a call needs the id its "
                    "tool message answers",
                    f"messages[{i}].tool_calls[{j}].id",
                )
            call_ids.add(c.id)
            p = f"messages[{i}].tool_calls[{j}].function.arguments"
            args = c.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise ApiError(f"{p} is not JSON", p) from None
            function = {"name": c.function.name, "arguments": args}
            calls.append({"id": c.id, "type": "function", "function": function})
        m["tool_calls"] = calls
