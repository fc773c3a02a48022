"""Incremental scanning of JSON values and of call objects (`{"name": ..., "arguments":
...}`) in text that may end anywhere. Regular expressions carry the character work, so
rescanning a growing output stays cheap."""

from __future__ import annotations

import enum
import json
import re
from typing import NamedTuple


class Status(enum.Enum):
    COMPLETE = "complete"  # the value / object ends inside the text
    PARTIAL = "partial"  # the text ends inside it (it may still complete)
    INVALID = "invalid"  # no continuation makes it one


_WS = re.compile(r"\s*")
# a string (complete, or cut by the end of the text), or a bracket
_OBJECT_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[{}\[\]]', re.S)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_SCALAR = re.compile(r"[-+0-9.eEa-zA-Z]+")


def skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


class Span(NamedTuple):
    status: Status
    end: int  # COMPLETE: the index after the value; else the end of the text


def value_span(text: str, i: int, final: bool) -> Span:
    """The JSON value starting at text[i] (not whitespace). Brackets are balanced and
    strings closed; the insides are not validated (arguments are the model's text)."""
    first = text[i]
    if first in "{[":
        depth = 0
        for m in _OBJECT_TOKEN.finditer(text, i):
            tok = m.group()
            if tok[0] == '"':
                if not (len(tok) > 1 and tok.endswith('"') and _STRING.fullmatch(tok)):
                    return Span(Status.PARTIAL, len(text))
            elif tok in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return Span(Status.COMPLETE, m.end())
        return Span(Status.PARTIAL, len(text))
    if first == '"':
        m = _STRING.match(text, i)
        return Span(Status.COMPLETE, m.end()) if m else Span(Status.PARTIAL, len(text))
    m = _SCALAR.match(text, i)
    if m is None:
        return Span(Status.INVALID, i)
    if m.end() == len(text) and not final:
        return Span(Status.PARTIAL, len(text))
    return Span(Status.COMPLETE, m.end())


class CallObject(NamedTuple):
    status: Status  # of the object as a whole
    name: str | None  # the "name" member once its string is complete
    arguments: str  # the raw text of the arguments member so far ("" when not reached)
    end: int  # COMPLETE: the index after "}"; else where the scan stopped


def call_object(text: str, i: int, arg_keys: tuple[str, ...], final: bool) -> CallObject:
    """Scan the object at text[i] == "{" for its name and arguments members."""
    assert text[i] == "{"
    name, args, pos, first = None, "", i + 1, True
    while True:
        pos = skip_ws(text, pos)
        if pos == len(text):
            return CallObject(Status.PARTIAL, name, args, pos)
        if text[pos] == "}":
            return CallObject(Status.COMPLETE, name, args, pos + 1)
        if not first:
            if text[pos] != ",":
                return CallObject(Status.INVALID, name, args, pos)
            pos = skip_ws(text, pos + 1)
            if pos == len(text):
                return CallObject(Status.PARTIAL, name, args, pos)
        first = False
        key = _STRING.match(text, pos)
        if key is None:
            status = Status.PARTIAL if text[pos] == '"' else Status.INVALID
            return CallObject(status, name, args, pos)
        pos = skip_ws(text, key.end())
        if pos == len(text):
            return CallObject(Status.PARTIAL, name, args, pos)
        if text[pos] != ":":
            return CallObject(Status.INVALID, name, args, pos)
        pos = skip_ws(text, pos + 1)
        if pos == len(text):
            return CallObject(Status.PARTIAL, name, args, pos)
        span = value_span(text, pos, final)
        if span.status is Status.INVALID:
            return CallObject(Status.INVALID, name, args, pos)
        key_name = _string(key.group())
        if key_name in arg_keys:
            args = text[pos : span.end].rstrip()
        elif key_name == "name" and span.status is Status.COMPLETE:
            value = _string(text[pos : span.end])
            if value is None:
                return CallObject(Status.INVALID, name, args, pos)
            name = value
        if span.status is Status.PARTIAL:
            return CallObject(Status.PARTIAL, name, args, span.end)
        pos = span.end


def _string(token: str) -> str | None:
    """The JSON string `token` decoded (None: not a string, or a bad escape)."""
    if not token.startswith('"'):
        return None
    try:
        return json.loads(token)
    except ValueError:
        return None
