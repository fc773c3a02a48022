"""Bounded nesting for JSON from clients, checked without recursion.

Python's `json` and msgspec recurse once per nesting level and raise RecursionError near
the interpreter's recursion limit (~1,000 levels: a 2 KB string gets there). Checking the
depth first, iteratively, turns such input into a ValueError the caller can name a field
in, and keeps every later recursive walk (json.dumps, a grammar compiler) far from the
limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

MAX_JSON_DEPTH = 128  # objects and arrays nested in one another at most (a schema: ~10)

# the structural characters that matter for depth, and whole strings (skipped at C speed)
_TOKENS = re.compile(r'[\[\]{}]|"(?:[^"\\]|\\.)*"?', re.DOTALL)


def text_depth_exceeds(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text `text` nests objects/arrays more than `limit` deep (brackets
    inside strings do not count). Valid or not: the caller's parser judges the rest."""
    depth = 0
    for m in _TOKENS.finditer(text):
        c = m.group()[0]
        if c == "[" or c == "{":
            depth += 1
            if depth > limit:
                return True
        elif c == "]" or c == "}":
            depth -= 1
    return False


_PATH_TOKENS = re.compile(r'[\[\]{}:,]|"(?:[^"\\]|\\.)*"?', re.DOTALL)


def too_deep_path(
    text: str, limit: int = MAX_JSON_DEPTH, parts: int = 2, max_tokens: int = 1_000_000
) -> str | None:
    """Where the JSON text `text` first nests deeper than `limit`: the path of the value
    holding that point, cut to its first `parts` components ("sampling_params.json_schema",
    "messages[0]"); None when nothing is that deep within the first `max_tokens` structural
    tokens (strings, brackets, colons, commas)."""
    frames: list[list] = []  # per open container: [is_object, key or index]
    last_string = ""
    for n, m in enumerate(_PATH_TOKENS.finditer(text)):
        if n >= max_tokens:
            return None
        tok = m.group()
        c = tok[0]
        if c == '"':
            last_string = tok
        elif c == "{" or c == "[":
            frames.append([c == "{", None if c == "{" else 0])
            if len(frames) > limit:
                return _format_path([f[1] for f in frames[:-1]][:parts])
        elif c == "}" or c == "]":
            if frames:
                frames.pop()
        elif frames and frames[-1][0] and c == ":":
            try:
                frames[-1][1] = json.loads(last_string)
            except ValueError:
                frames[-1][1] = last_string.strip('"')
        elif frames and not frames[-1][0] and c == ",":
            frames[-1][1] += 1
    return None


def _format_path(keys: list) -> str | None:
    path = ""
    for k in keys:
        if isinstance(k, int):
            path += f"[{k}]"
        else:
            path += f".{k}" if path else str(k)
    return path or None


def value_depth_exceeds(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the decoded JSON `value` (dicts, lists, tuples, scalars) nests containers
    more than `limit` deep. Visits each container once, with an explicit stack."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, Mapping):
            children = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        if depth + 1 > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False
