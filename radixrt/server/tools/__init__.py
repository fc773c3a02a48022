"""Tool calling: the call formats of model families (one module each), streaming, the
request's tools and choice, and the constraints that make calls valid by construction."""

from __future__ import annotations

from radixrt.server.tools.base import Tool, ToolCall, ToolFormat

# --tool-call-parser values
TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
# chat-template text -> the format its model writes (first match wins)
_TEMPLATE_HINTS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"),
                   ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"))  # fmt: skip


def create_tool_format(name: str, tool_names: frozenset[str] | None = None) -> ToolFormat:
    """The format `name` (one of TOOL_PARSERS); `tool_names`: the offered tools (formats
    that tell calls from plain JSON by name use them)."""
    if name == "hermes":
        from radixrt.server.tools.hermes import HermesFormat

        return HermesFormat()
    if name == "llama3_json":
        from radixrt.server.tools.llama3 import Llama3JsonFormat

        return Llama3JsonFormat(tool_names)
    if name == "mistral":
        from radixrt.server.tools.mistral import MistralFormat

        return MistralFormat()
    raise ValueError(f"unknown tool call parser {name!r}; allowed: {', '.join(TOOL_PARSERS)}")


def default_tool_parser(chat_template: str | None) -> str:
    """The format a chat template's model writes (hermes when the template says nothing)."""
    for hint, name in _TEMPLATE_HINTS:
        if chat_template and hint in chat_template:
            return name
    return "hermes"


__all__ = ["TOOL_PARSERS", "Tool", "ToolCall", "ToolFormat", "create_tool_format",
           "default_tool_parser"]  # fmt: skip
