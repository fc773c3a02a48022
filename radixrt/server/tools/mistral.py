"""Mistral calls: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (Mistral 7B v0.3,
Mixtral 8x22B, Mistral Nemo / Small templates), and the later `[TOOL_CALLS]f[ARGS]{...}`.
`[TOOL_CALLS]` and `[ARGS]` are special tokens, so the output keeps special tokens."""

from __future__ import annotations

import json
import re
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
from radixrt.server.tools.json_scan import Status, call_object, skip_ws, value_span

START, ARGS = "[TOOL_CALLS]", "[ARGS]"
ARG_KEYS = ("arguments", "parameters")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralFormat(ToolFormat):
    name = "mistral"
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        pos = 0
        while True:
            k = text.find(START, pos)
            if k < 0:
                rest = text[pos:]
                content.append(rest if final else rest[: len(rest) - held_back(rest, START)])
                break
            content.append(text[pos:k])
            j = skip_ws(text, k + len(START))
            if j == len(text):
                break
            end = self._calls(text, j, final, calls)
            if end is None:
                break  # the text ends inside the calls
            pos = end
        if final:
            for call in calls:
                call.arguments = call.arguments or "{}"
                call.complete = True
        return Scan("".join(content), calls)

    def _calls(self, text: str, j: int, final: bool, calls: list[PartialCall]) -> int | None:
        """Append the calls after a marker (at text[j]); the index after them, or None when
        the text ends inside them (or they are not calls: dropped with the marker)."""
        if text[j] == "[":  # a list of call objects
            pos = skip_ws(text, j + 1)
            while pos < len(text) and text[pos] == "{":
                obj = call_object(text, pos, ARG_KEYS, final)
                if obj.name is not None:
                    calls.append(
                        PartialCall(obj.name, obj.arguments, obj.status is Status.COMPLETE)
                    )
                if obj.status is not Status.COMPLETE:
                    return None if obj.status is Status.PARTIAL else obj.end
                pos = skip_ws(text, obj.end)
                if text.startswith(",", pos):
                    pos = skip_ws(text, pos + 1)
            if pos == len(text):
                return None
            return pos + 1 if text[pos] == "]" else pos
        if text[j] == "{":  # one call object
            obj = call_object(text, j, ARG_KEYS, final)
            if obj.name is not None:
                calls.append(PartialCall(obj.name, obj.arguments, obj.status is Status.COMPLETE))
            return obj.end if obj.status is not Status.PARTIAL else None
        name = _NAME.match(text, j)  # name[ARGS]{...}
        if name is None:
            return j
        a = name.end()
        if not text.startswith(ARGS, a):
            return None if ARGS.startswith(text[a:]) else a
        v = skip_ws(text, a + len(ARGS))
        if v == len(text):
            calls.append(PartialCall(name.group(), ""))
            return None
        span = value_span(text, v, final)
        args = text[v : span.end].rstrip() if span.status is not Status.INVALID else ""
        calls.append(PartialCall(name.group(), args, span.status is Status.COMPLETE))
        return span.end if span.status is not Status.PARTIAL else None

    def call_tag(self, tool: Tool) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f'{{"name": {json.dumps(tool.name)}, "arguments": ',
            "content": arguments_format(tool),
            "end": "}",
        }

    def calls_format(self, tools: list[Tool], *, at_least_one: bool, max_calls: int) -> dict:
        calls = calls_sequence([self.call_tag(t) for t in tools], ", ", max_calls)
        block = {"type": "tag", "begin": START + "[", "content": calls, "end": "]"}
        if at_least_one:
            return block
        return {"type": "triggered_tags", "triggers": [START], "tags": [block],
                "stop_after_first": True}  # fmt: skip
