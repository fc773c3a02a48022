"""Hermes / Qwen calls: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, any
number of them among the text (NousResearch Hermes 2 Pro, Qwen2.5 and Qwen3 templates)."""

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
    held_back,
)
from radixrt.server.tools.json_scan import Status, call_object, skip_ws

START, END = "<tool_call>", "</tool_call>"
ARG_KEYS = ("arguments", "parameters")


class HermesFormat(ToolFormat):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        pos = 0
        while True:
            k = text.find(START, pos)
            if k < 0:
                rest = text[pos:]
                rest = rest if final else rest[: len(rest) - held_back(rest, START)]
                if not (calls and rest.isspace()):  # blanks after a call: a separator
                    content.append(rest)
                break
            if not (calls and text[pos:k].isspace()):
                content.append(text[pos:k])
            j = skip_ws(text, k + len(START))
            if j == len(text):  # the marker alone so far
                if final:
                    content.append(text[k:])
                break
            obj = call_object(text, j, ARG_KEYS, final) if text[j] == "{" else None
            if obj is None or obj.name is None:
                if obj is not None and obj.status is Status.PARTIAL and not final:
                    break  # may still become a call: held back
                content.append(START)  # not a call: the marker is text
                pos = k + len(START)
                continue
            call = PartialCall(obj.name, obj.arguments)
            calls.append(call)
            if obj.status is Status.PARTIAL:
                call.complete = final
                break
            close = text.find(END, obj.end)
            if close < 0:  # text up to the closing marker belongs to the call
                call.complete = final
                break
            call.complete = True
            pos = close + len(END)
        if final:
            for call in calls:
                call.arguments = call.arguments or "{}"
        return Scan("".join(content), calls)

    def call_tag(self, tool: Tool) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f'{START}\n{{"name": {json.dumps(tool.name)}, "arguments": ',
            "content": arguments_format(tool),
            "end": f"}}\n{END}",
        }

    def calls_format(self, tools: list[Tool], *, at_least_one: bool, max_calls: int) -> dict:
        tags = [self.call_tag(t) for t in tools]
        if at_least_one:
            return calls_sequence(tags, "\n", max_calls)
        return {
            "type": "triggered_tags",
            "triggers": [START],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": max_calls == 1,
        }
