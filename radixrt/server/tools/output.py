"""Chat responses with tool calls: `message.tool_calls` and `finish_reason: "tool_calls"`,
whole or streamed."""

from __future__ import annotations

import json
from typing import Any

from radixrt.server.tools.request import ToolRequest
from radixrt.server.tools.stream import ToolStream, parse_calls


def _reason(finish_reason: str | None, num_calls: int) -> str | None:
    """A generation that stopped after calls finished with them (a cut one stays "length")."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def chat_message(text: str, finish_reason: str | None, tools: ToolRequest | None):
    """(the choice's `message`, its finish_reason)."""
    if tools is None or tools.fmt is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse_calls(tools.fmt, text)
    calls = [c for c in calls if _is_object(c.arguments)]  # a call cut short is dropped
    if not calls:
        return {"role": "assistant", "content": content}, finish_reason
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content if content.strip() else None,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ],
    }
    return message, _reason(finish_reason, len(calls))


def _is_object(arguments: str) -> bool:
    """The arguments are a whole JSON object (not the start of one that `max_tokens` cut)."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


class ChatDeltas:
    """Per choice of a streamed chat response: each text delta as a `delta` object."""

    def __init__(self, tools: ToolRequest | None) -> None:
        self.tools = tools if tools is not None and tools.fmt is not None else None
        self._streams: dict[int, ToolStream] = {}

    def delta(self, index: int, text: str, finish_reason: str | None):
        """(the chunk's `delta`, its finish_reason) for choice `index`'s new `text`."""
        if self.tools is None:
            return ({"content": text} if text else {}), finish_reason
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = ToolStream(self.tools.fmt)
        d = stream.feed(text, final=finish_reason is not None)
        out: dict[str, Any] = {}
        if d.content:
            out["content"] = d.content
        if d.tool_calls:
            out["tool_calls"] = d.tool_calls
        return out, _reason(finish_reason, len(stream.ids))
