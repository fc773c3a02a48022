"""Group a cProfile of the front process into per-token cost groups (self time).

The idle wait of the event loop (epoll) is `IDLE`, not one of `GROUPS`.

Python functions are grouped by the path of their module (not by function name: the front's
functions change; `STOP_FUNCTIONS` is the one name-based refinement, because stop strings
live in the detokenizer's module today). A built-in (C) function's self time goes to the
groups of its callers, in proportion to the time spent in it from each caller, unless a
rule names it (msgspec's JSON encoder is "JSON encode" wherever it is called from).
"""

from __future__ import annotations

import pstats
import re
from collections import defaultdict

GROUPS = (
    "ZMQ recv + msgpack decode",
    "detokenize",
    "stop strings",
    "JSON encode",
    "SSE write (aiohttp, transport)",
    "HTTP request in (aiohttp, parse)",
    "route handlers (event shaping)",
    "front bookkeeping (front, state, metrics)",
    "asyncio loop + other",
)

IDLE = "idle (epoll wait)"

# (group, regex on the path with "/" separators); the first match wins
PATH_RULES = (
    (GROUPS[0], r"/zmq/|radixrt/server/channel\.py$|/msgspec/"),
    (GROUPS[2], r"radixrt/.*stop[^/]*\.py$"),
    (GROUPS[1], r"radixrt/detokeniz|/transformers/|/tokenizers/"),
    (GROUPS[3], r"/json/"),
    (GROUPS[4], r"radixrt/server/http_util\.py$|aiohttp/(web_response|http_writer|abc)\.py$"),
    (GROUPS[6], r"radixrt/server/(http_api|openai_routes)\.py$"),
    (GROUPS[5], r"/aiohttp/|/multidict/|/yarl/|radixrt/server/(validate|protocol|schemas)\.py$"),
    (GROUPS[7], r"radixrt/|/prometheus_client/"),
)
STOP_FUNCTIONS = re.compile(r"stop|held_back|release")  # in the detokenizer's module
# asyncio's socket transport: its write path is the SSE write, the rest is the loop
TRANSPORT_WRITE = re.compile(r"write|_send")
# built-ins named by a rule, whoever calls them
BUILTIN_RULES = (
    (IDLE, r"of 'select\.epoll' objects"),
    (GROUPS[3], r"of 'msgspec\.json\.Encoder'|^<built-in method _json|encode_basestring"),
    (GROUPS[0], r"of 'msgspec\.msgpack\.Decoder'|zmq"),
)

Func = tuple[str, int, str]  # pstats' key: (file, line, function name)


def group_of(func: Func) -> str | None:
    """The group of a Python function, or of a built-in named by a rule; None: a built-in
    that goes to its callers."""
    path, _, name = func
    path = path.replace("\\", "/")
    if path == "~":
        for group, pattern in BUILTIN_RULES:
            if re.search(pattern, name):
                return group
        return None
    if re.search(r"/asyncio/selector_events\.py$", path) and TRANSPORT_WRITE.search(name):
        return GROUPS[4]
    for group, pattern in PATH_RULES:
        if re.search(pattern, path):
            if group == GROUPS[1] and "radixrt/detokeniz" in path and STOP_FUNCTIONS.search(name):
                return GROUPS[2]
            return group
    return GROUPS[8]


def group_profile(path: str) -> dict[str, float]:
    """Self seconds per group (every group of GROUPS, in that order, then IDLE) of a
    cProfile dump."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    totals: dict[str, float] = defaultdict(float)
    for func, (_, _, tottime, _, callers) in stats.items():
        for group, seconds in _attribute(stats, func, tottime, callers, depth=0):
            totals[group] += seconds
    return {g: totals.get(g, 0.0) for g in (*GROUPS, IDLE)}


def _attribute(stats: dict, func: Func, seconds: float, callers: dict, depth: int):
    """(group, seconds) pairs for `seconds` of self time of `func`."""
    group = group_of(func)
    if group is not None:
        return [(group, seconds)]
    weights = {c: v[2] for c, v in callers.items()}  # caller -> self time of func from it
    total = sum(weights.values())
    if depth > 8 or not callers or total <= 0:
        return [(GROUPS[8], seconds)]
    out = []
    for caller, w in weights.items():
        share = seconds * w / total
        caller_callers = stats[caller][4] if caller in stats else {}
        out += _attribute(stats, caller, share, caller_callers, depth + 1)
    return out


def top_functions(path: str, n: int = 5) -> dict[str, list[tuple[str, float]]]:
    """Per group, its `n` largest contributors: ("file:line(function)", self seconds)."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    by_group: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for func, (_, _, tottime, _, callers) in stats.items():
        name = f"{_short_path(func[0])}:{func[1]}({func[2]})"
        for group, seconds in _attribute(stats, func, tottime, callers, depth=0):
            by_group[group][name] += seconds
    return {
        g: sorted(by_group[g].items(), key=lambda kv: -kv[1])[:n]
        for g in (*GROUPS, IDLE)
        if g in by_group
    }


def _short_path(path: str) -> str:
    """The path from its package on (site-packages/..., radixrt/...)."""
    path = path.replace("\\", "/")
    for marker in ("site-packages/", "/lib/python3", "/radixrt/", "/benchmarks/"):
        if marker in path:
            return (
                path.split(marker, 1)[1]
                if marker.endswith("/")
                else marker[1:] + path.split(marker, 1)[1]
            )
    return path
