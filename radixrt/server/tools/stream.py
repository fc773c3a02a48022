"""Streaming tool calls: the differences between scans of the growing output, shaped as
OpenAI streams them (a call's first delta carries its index, id, type and name with empty
arguments; later deltas carry argument fragments)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from radixrt.server.tools.base import Scan, ToolCall, ToolFormat


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolStreamDelta:
    content: str  # new content text
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI `delta.tool_calls` items


class ToolStream:
    """Feed the output's text deltas; each feed returns what is new. The last feed (with
    `final`) flushes what was held back; the concatenated deltas equal `fmt.parse` of
    the whole text."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.ids: list[str] = []  # per call sent so far
        self._content_sent = 0  # characters of content sent
        self._args_sent: list[int] = []  # per call: characters of its arguments sent
        self.scan = Scan("")  # the latest scan

    def feed(self, delta: str, final: bool = False) -> ToolStreamDelta:
        self.text += delta
        scan = self.scan = self.fmt.scan(self.text, final)
        assert len(scan.content) >= self._content_sent, "a scan took back content"
        out = ToolStreamDelta(scan.content[self._content_sent :])
        self._content_sent = len(scan.content)
        for i, call in enumerate(scan.calls):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self._args_sent.append(0)
                function = {"name": call.name, "arguments": ""}
                out.tool_calls.append(
                    {"index": i, "id": self.ids[i], "type": "function", "function": function}
                )
            fragment = call.arguments[self._args_sent[i] :]
            if fragment:
                self._args_sent[i] = len(call.arguments)
                out.tool_calls.append({"index": i, "function": {"arguments": fragment}})
        return out

    def calls(self) -> list[ToolCall]:
        """The calls of the latest scan, with the ids streamed."""
        return [ToolCall(i, c.name, c.arguments) for i, c in zip(self.ids, self.scan.calls)]


def parse_calls(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    """The whole output's content and calls (new ids)."""
    scan = fmt.parse(text)
    return scan.content, [ToolCall(new_call_id(), c.name, c.arguments) for c in scan.calls]
