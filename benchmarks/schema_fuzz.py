"""Request bodies drawn from the route schemas (radixrt.server.schemas), field by field.

For every field of /v1/completions, /v1/chat/completions and /generate (sampling_params
included) the field's declared type (msgspec.inspect) gives three kinds of value:

- valid: of the declared type, inside the declared range (a neutral field: an accepted
  value; a field with a meaning, e.g. regex or tools: a well-formed sample);
- boundary: the declared range's ends (and the sampling ranges of radixrt.sampling);
- invalid: just outside the range, a neutral field off its accepted values, or a JSON type
  the field does not take. The server must refuse these with a 4xx.

`schema_case` returns one body with one field set so; every answer must be a 200 or a
4xx, never a 5xx. Used by tests/test_server_fuzz.py and benchmarks/fuzz_campaign.py.
"""

from __future__ import annotations

import functools
import json
import random
import urllib.error
import urllib.request
from typing import Any, NamedTuple

import msgspec
from msgspec import inspect as mi

from radixrt import sampling
from radixrt.server.schemas import (
    NEUTRAL,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
)

COMP, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
ROUTES = {COMP: CompletionRequest, CHAT: ChatCompletionRequest, GEN: GenerateRequest}
KINDS = ("valid", "boundary", "invalid")

# ranges radixrt.sampling checks on fields whose schema type carries none: (lo, hi)
SAMPLING_RANGES: dict[str, tuple[float | None, float | None]] = {
    "temperature": (0.0, None),
    "top_p": (1e-6, 1.0),  # (0, 1]
    "min_p": (0.0, 1.0),
    "top_k": (-1, sampling.MAX_INT),
    "seed": (0, sampling.SEED_RANGE - 1),
    "sampling_seed": (0, sampling.SEED_RANGE - 1),
    "presence_penalty": (-sampling.PENALTY_RANGE, sampling.PENALTY_RANGE),
    "frequency_penalty": (-sampling.PENALTY_RANGE, sampling.PENALTY_RANGE),
    "repetition_penalty": (sampling.MIN_REPETITION_PENALTY, sampling.MAX_REPETITION_PENALTY),
    "beam_width": (1, sampling.MAX_BEAM_WIDTH),
    "length_penalty": (-sampling.LENGTH_PENALTY_RANGE, sampling.LENGTH_PENALTY_RANGE),
    "n": (1, sampling.MAX_N),
    "logprobs": (0, sampling.MAX_TOP_LOGPROBS),
}
# the largest prompt/output the fuzz asks for (a small KV pool: requests must stay small)
MAX_NEW = 4

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# well-formed samples of fields whose strings or objects have a meaning
SAMPLES: dict[str, list[Any]] = {
    "regex": ["[a-z]{1,3}", "(yes|no)", r"\d+", "a*"],
    "guided_regex": ["[a-z]{1,3}", "(yes|no)"],
    "json_schema": [SCHEMA, json.dumps(SCHEMA), {"type": "string", "maxLength": 3}],
    "guided_json": [SCHEMA, {"type": "boolean"}],
    "ebnf": ['root ::= "a" | "b"', "root ::= [0-9]+"],
    "guided_grammar": ['root ::= "yes" | "no"'],
    "guided_choice": [["yes", "no"], ["a"]],
    "structural_tag": [
        {
            "type": "structural_tag",
            "structures": [{"begin": "<a>", "schema": SCHEMA, "end": "</a>"}],
            "triggers": ["<a>"],
        },
        json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}),
    ],
    "response_format": [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    ],
    "stop": ["\n", ["a", "b"], [], "."],
    "stop_regex": [r"\d", ["[.!?]", "b+"]],
    "stop_token_ids": [[0], [1, 2]],
    "logit_bias": [{"5": 1.5}, {"7": -100}, {"9": 100}],
    "tools": [TOOLS],
    "tool_choice": [
        "none",
        "auto",
        "required",
        {"type": "function", "function": {"name": "weather"}},
    ],
    "messages": [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": [{"type": "text", "text": "a b"}]}],
    ],
    "prompt": ["hi", ["a", "b"], [5, 6, 7], [[1, 2], [3]]],
    "text": ["hi", ["a", "b"]],
    "input_ids": [[5, 6, 7], [[1, 2], [3]]],
    "stream_options": [{"include_usage": True}, {"continuous_usage_stats": True}],
    "model": [None, "", "unknown"],
    "sampling_params": [{"max_new_tokens": 2, "temperature": 0}, {"max_new_tokens": 3, "n": 2}],
}
STRINGS = ["", "a", "é😀\u2028", "\x00", "<|user|>", "x" * 300]


class FieldValue(NamedTuple):
    path: str  # the route
    field: str  # dotted ("sampling_params.top_k")
    kind: str  # valid | boundary | invalid
    value: Any


def field_types(schema: type[msgspec.Struct]) -> dict[str, mi.Type]:
    return {f.encode_name: f.type for f in mi.type_info(schema).fields}


@functools.cache
def route_fields(path: str) -> dict[str, mi.Type]:
    """Every field of the route: dotted name -> declared type (sampling_params' own)."""
    out = field_types(ROUTES[path])
    if path == GEN:
        out.update(
            {f"sampling_params.{k}": t for k, t in field_types(GenerateSamplingParams).items()}
        )
    return out


def _unwrap(t: mi.Type) -> tuple[mi.Type, tuple[Any, ...] | None]:
    """(the type without Metadata, the accepted values if it is neutral)."""
    accepted = None
    while isinstance(t, mi.Metadata):
        accepted = (t.extra or {}).get(NEUTRAL, accepted)
        t = t.type
    return t, accepted


def _members(t: mi.Type) -> list[mi.Type]:
    t, _ = _unwrap(t)
    return [_unwrap(m)[0] for m in t.types] if isinstance(t, mi.UnionType) else [t]


def _bounds(t: mi.Type, name: str) -> tuple[Any, Any]:
    lo = getattr(t, "ge", None)
    hi = getattr(t, "le", None)
    if lo is None and hi is None and name in SAMPLING_RANGES:
        lo, hi = SAMPLING_RANGES[name]
    return lo, hi


def _valid_of(t: mi.Type, name: str, rng: random.Random, depth: int = 0) -> Any:
    """A value of type `t` inside its range."""
    if isinstance(t, mi.IntType):
        lo, hi = _bounds(t, name)
        lo = 0 if lo is None else lo
        return rng.randint(lo, min(lo + 3, lo if hi is None else hi))
    if isinstance(t, mi.FloatType):
        lo, hi = _bounds(t, name)
        lo = 0.0 if lo is None else lo
        return round(rng.uniform(lo, min(lo + 1.0, lo + 1.0 if hi is None else hi)), 3)
    if isinstance(t, mi.StrType):
        return rng.choice([s for s in STRINGS if len(s) >= (t.min_length or 0)][:5])
    if isinstance(t, mi.BoolType):
        return rng.random() < 0.5
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.ListType):
        if depth > 2:
            return []
        return [_valid_of(t.item_type, "", rng, depth + 1) for _ in range(rng.randint(0, 2))]
    if isinstance(t, mi.DictType):
        return {"k": _valid_of(t.value_type, "", rng, depth + 1)} if depth < 3 else {}
    if isinstance(t, mi.StructType):
        out = {}
        for f in t.fields:
            if f.required or rng.random() < 0.3:
                out[f.encode_name] = _valid_of(_unwrap(f.type)[0], f.encode_name, rng, depth + 1)
        return out
    if isinstance(t, mi.UnionType):
        return _valid_of(_unwrap(rng.choice(t.types))[0], name, rng, depth)
    return rng.choice([None, 0, "a", [], {}, True])  # Any


def _boundaries(t: mi.Type, name: str) -> list[Any]:
    out: list[Any] = []
    for m in _members(t):
        if isinstance(m, (mi.IntType, mi.FloatType)):
            lo, hi = _bounds(m, name)
            out += [v for v in (lo, hi) if v is not None]
            if hi is None:
                out += [sampling.MAX_INT, 2**53] if isinstance(m, mi.IntType) else [1e300]
        elif isinstance(m, mi.StrType):
            out += ["x" * (m.min_length or 0)]
            if m.max_length is not None:
                out += ["x" * m.max_length]
        elif isinstance(m, mi.ListType):
            out += [[]]
    return out


def _invalids(t: mi.Type, name: str, accepted: tuple[Any, ...] | None) -> list[Any]:
    """Values the schema (or the neutral check, or radixrt.sampling) must refuse."""
    if accepted is not None:  # neutral: another value of the type
        return [
            v
            for v in (True, 2, "on", 0.5)
            if not any(v == a and type(v) is type(a) for a in accepted)
        ]
    members = _members(t)
    if any(isinstance(m, mi.AnyType) for m in members):
        return []
    out: list[Any] = []
    for m in members:
        if isinstance(m, mi.IntType):
            lo, hi = _bounds(m, name)
            out += [
                v
                for v in (None if lo is None else lo - 1, None if hi is None else hi + 1)
                if v is not None
            ]
        elif isinstance(m, mi.FloatType):
            lo, hi = _bounds(m, name)
            if lo is not None:
                out.append(lo - max(abs(lo), 1) * 1e-3 - 1e-6)
            if hi is not None:
                out.append(hi + max(abs(hi), 1) * 1e-3 + 1e-6)
        elif isinstance(m, mi.StrType) and m.max_length is not None:
            out.append("x" * (m.max_length + 1))
        elif isinstance(m, mi.StrType) and m.min_length:
            out.append("")
    # a JSON type no member takes
    takes = {type(m) for m in members}
    if not takes & {mi.DictType, mi.StructType}:
        out.append({"not": "this"})
    if not takes & {mi.ListType}:
        out.append([1, "a"])
    if not takes & {mi.StrType}:
        out.append("seven")
    if not takes & {mi.IntType, mi.FloatType, mi.BoolType}:  # msgspec takes no bool as int
        out.append(7.5)
    return out


def field_value(path: str, field: str, kind: str, rng: random.Random) -> Any:
    t = route_fields(path)[field]
    name = field.rsplit(".", 1)[-1]
    bare, accepted = _unwrap(t)
    if kind == "valid":
        if accepted is not None:
            return rng.choice(accepted)
        if name in SAMPLES and rng.random() < 0.8:
            return rng.choice(SAMPLES[name])
        return _valid_of(bare, name, rng)
    if kind == "boundary":
        values = [] if accepted is not None else _boundaries(bare, name)
        return rng.choice(values) if values else field_value(path, field, "valid", rng)
    values = _invalids(bare, name, accepted)
    assert values, f"{field} has no invalid value (see has_invalid)"
    return rng.choice(values)


def has_invalid(path: str, field: str) -> bool:
    """Whether the schema refuses some value of `field` (an `Any` field takes every one)."""
    bare, accepted = _unwrap(route_fields(path)[field])
    return bool(_invalids(bare, field.rsplit(".", 1)[-1], accepted))


def base_body(path: str, rng: random.Random) -> dict[str, Any]:
    """A small request that succeeds."""
    k = rng.randint(1, MAX_NEW)
    text = rng.choice(["hi", "a b c a b c a b c", "The list: 1, 2, 1, 2,"])
    if path == COMP:
        return {"prompt": text, "max_tokens": k}
    if path == CHAT:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": k}
    return {"text": text, "sampling_params": {"max_new_tokens": k}}


def _set(body: dict[str, Any], field: str, value: Any) -> None:
    if field.startswith("sampling_params."):
        if not isinstance(body.get("sampling_params"), dict):
            body["sampling_params"] = {}
        body["sampling_params"][field.split(".", 1)[1]] = value
    else:
        body[field] = value


# size-type fields a fuzz value must not blow up (a huge max_tokens on a valid body would
# run for minutes on the CPU): valid/boundary values of these are capped
CAPPED = {"max_tokens", "max_new_tokens", "max_completion_tokens", "min_tokens", "min_new_tokens"}


def schema_case(rng: random.Random, path: str | None = None) -> tuple[FieldValue, dict[str, Any]]:
    """One body with one schema field set to a valid, boundary or invalid value."""
    path = path or rng.choice(list(ROUTES))
    field = rng.choice(list(route_fields(path)))
    kind = rng.choice(KINDS)
    if kind == "invalid" and not has_invalid(path, field):
        kind = "valid"
    value = field_value(path, field, kind, rng)
    name = field.rsplit(".", 1)[-1]
    body = base_body(path, rng)
    if kind != "invalid" and name in CAPPED and isinstance(value, int) and value > MAX_NEW:
        # a huge output budget stays a boundary case through min_tokens/ignore_eos only
        # when the model can finish it; keep the length small and the min below it
        value = MAX_NEW
    _set(body, field, value)
    if name in ("n", "beam_width", "best_of") and kind != "invalid":
        _set(body, "sampling_params.max_new_tokens" if path == GEN else "max_tokens", 2)
    if rng.random() < 0.15 and kind != "invalid":
        body["stream"] = True
    return FieldValue(path, field, kind, value), body


def post(url: str, data: bytes, timeout: float) -> tuple[int, bytes]:
    """(status, raw body) of a JSON POST (a stream: all of its events)."""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def answer_problem(case: FieldValue, status: int, raw: bytes) -> str:
    """'' if the answer fits the case, else what is wrong: never a 5xx; an error is
    OpenAI-shaped, and an invalid value's is a 4xx naming a field (a valid value may still
    be refused by a check the schema does not declare, e.g. the KV pool's size, which
    names none)."""
    if status >= 500 or status < 200:
        return f"status {status}: {raw[:300]!r}"
    if status == 200:
        if case.kind == "invalid":
            return f"invalid value accepted: {case.value!r:.100}"
        text = raw.decode(errors="replace").rstrip()
        if text.startswith("data:") and not text.endswith("data: [DONE]"):
            return f"stream without [DONE]: {text[-200:]!r}"
        return ""
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without an OpenAI error: {raw[:300]!r}"
    if not err.get("message"):
        return f"{status} error without a message: {err}"
    if case.kind == "invalid" and not err.get("param"):  # a schema error names its field
        return f"{status} error naming no field: {err}"
    return ""


def rss_kb(pid: int) -> int:
    """VmRSS of `pid` in KiB (/proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")
