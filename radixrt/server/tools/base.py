"""Tool calls as plain data and the contract of a tool-call format (torch-free).

A format reads a model's output text as content plus calls. `scan(text, final)` parses
the text generated so far; a non-final scan holds back what might still become a call
(a marker's first characters, a call whose name is not complete) and reports calls in
progress. Scans of growing prefixes only ever extend what an earlier scan reported
(content, each call's name and arguments text), which is what lets streaming send the
differences (`stream.ToolStream`) and end where the whole-text parse does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PartialCall:
    """A call as far as it was generated."""

    name: str  # the function's name (a call is reported once its name is complete)
    arguments: str  # the raw JSON text of its arguments so far (the model's own spelling)
    complete: bool = False  # the call's closing text was seen (or the output ended)


@dataclass
class Scan:
    """What a prefix of the output holds."""

    content: str  # the text outside calls that is certain to stay content
    calls: list[PartialCall] = field(default_factory=list)


@dataclass(frozen=True)
class Tool:
    """A function the client offers (OpenAI `tools[i].function`)."""

    name: str
    parameters: dict[str, Any]  # a JSON schema of its arguments object
    description: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """A finished call as the response carries it."""

    id: str  # "call_..."
    name: str
    arguments: str  # a JSON text ("{}" when the model gave none)


class ToolFormat(ABC):
    """One model family's way of writing tool calls."""

    name: str  # the --tool-call-parser value
    # the markers need special tokens in the text (the request keeps them in its output)
    keeps_special_tokens: bool = False
    # auto can be constrained: a marker starts every call (calls_format(at_least_one=False))
    constrains_auto: bool = True

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """Parse `text`, the output so far (`final`: all of it)."""

    @abstractmethod
    def call_tag(self, tool: Tool) -> dict[str, Any]:
        """xgrammar structural-tag `tag` format of one call of `tool` in this format
        (begin text, the arguments' JSON schema, end text)."""

    @abstractmethod
    def calls_format(self, tools: list[Tool], *, at_least_one: bool, max_calls: int) -> dict:
        """xgrammar structural-tag format of the whole output: 1 to `max_calls` calls of
        `tools` only (`at_least_one`: required / named) or text with calls that are
        constrained once started (auto, where `constrains_auto`; else ValueError; auto
        bounds only `max_calls` 1)."""

    def parse(self, text: str) -> Scan:
        """The whole output's content and calls."""
        return self.scan(text, final=True)


def held_back(text: str, marker: str) -> int:
    """Characters at the end of `text` that begin `marker` (they may still become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def calls_sequence(tags: list[dict[str, Any]], separator: str, max_calls: int) -> dict[str, Any]:
    """xgrammar structural-tag format of 1 to `max_calls` of `tags`, joined by `separator`:
    the output may end after each complete call and must end after the last one allowed (a
    model that repeats its call stops there rather than at `max_tokens`)."""
    if max_calls == 1:  # one call: xgrammar's own form
        return {"type": "tags_with_separator", "tags": tags, "separator": separator,
                "at_least_one": True, "stop_after_first": True}  # fmt: skip
    call = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    more = {"type": "sequence", "elements": [{"type": "const_string", "value": separator}, call]}
    return {
        "type": "sequence",
        "elements": [call, {"type": "repeat", "min": 0, "max": max_calls - 1, "content": more}],
    }


def arguments_format(tool: Tool) -> dict[str, Any]:
    """xgrammar structural-tag format of a call's arguments: JSON matching the tool's
    schema (the compile makes it compact JSON: `radixrt.grammar.compile_worker.compact_tag`)."""
    schema = tool.parameters or {"type": "object"}
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
