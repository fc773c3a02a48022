"""Llama 3.x JSON calls: the output is `{"name": "f", "parameters": {...}}` (Llama 3.1 /
3.2 / 3.3 templates with tools in the user turn), optionally after `<|python_tag|>`, several
separated by `;`. An output that does not start so is content, and so is a JSON object
whose name is not an offered tool (a plain JSON answer)."""

from __future__ import annotations

import json
from typing import Any

from radixrt.server.tools.base import (
    PartialCall,
    Scan,
    Tool,
    ToolFormat,
    arguments_format,
    calls_sequence,
)
from radixrt.server.tools.json_scan import Status, call_object, skip_ws

PYTHON_TAG = "<|python_tag|>"
ARG_KEYS = ("parameters", "arguments")
SEPARATOR = "; "


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    constrains_auto = False  # a call is recognised only at the start of the output

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        self.tool_names = tool_names  # names a call may have; None: any

    def scan(self, text: str, final: bool) -> Scan:
        pos = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_ws(text, pos + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[pos:]):
            return Scan("")  # may still be the tag (or a call after blanks)
        if pos == len(text):
            return Scan(text if final else "")
        if text[pos] != "{":
            return Scan(text)  # not a call: all content
        calls: list[PartialCall] = []
        while pos < len(text) and text[pos] == "{":
            obj = call_object(text, pos, ARG_KEYS, final)
            known = obj.name is not None and (
                self.tool_names is None or obj.name in self.tool_names
            )
            if not known:
                if obj.status is Status.PARTIAL and obj.name is None and not final:
                    return Scan("", calls)  # may still become a call
                return self._content(text, calls, pos, final)
            calls.append(PartialCall(obj.name, obj.arguments, complete=final))
            if obj.status is not Status.COMPLETE:
                break
            calls[-1].complete = True
            pos = skip_ws(text, obj.end)
            if text.startswith(";", pos):
                pos = skip_ws(text, pos + 1)
            if pos == len(text) or text[pos] != "{":
                return self._content(text, calls, pos, final)
        return self._finish(Scan("", calls), final)

    def _content(self, text: str, calls: list[PartialCall], pos: int, final: bool) -> Scan:
        """Calls so far, then the rest as content (everything when there are none)."""
        rest = text[pos:] if calls else text
        return self._finish(Scan(rest if (final or rest.strip()) else "", calls), final)

    @staticmethod
    def _finish(scan: Scan, final: bool) -> Scan:
        if final:
            for call in scan.calls:
                call.arguments = call.arguments or "{}"
        return scan

    def call_tag(self, tool: Tool) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f'{{"name": {json.dumps(tool.name)}, "parameters": ',
            "content": arguments_format(tool),
            "end": "}",
        }

    def calls_format(self, tools: list[Tool], *, at_least_one: bool, max_calls: int) -> dict:
        if not at_least_one:
            raise ValueError("llama3_json has no constrained auto mode")
        return calls_sequence([self.call_tag(t) for t in tools], SEPARATOR, max_calls)
