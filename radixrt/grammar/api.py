"""Structured-output fields of the HTTP API -> SamplingParams keywords (torch-free: the front
imports this).

`/generate` sampling_params: `regex`, `json_schema` (object or string), `ebnf`. OpenAI routes:
`response_format` {"type": "text"} | {"type": "json_object"} (any JSON object) |
{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}.
Types and sizes are checked here and by SamplingParams; whether the text compiles is known
only in the scheduler process (a compile error is a 400 from there, whose `param` the front
replaces by `grammar_param`: the field the client used).
"""

from __future__ import annotations

from typing import Any

from radixrt.grammar.spec import JSON_OBJECT_EBNF

# API field -> SamplingParams field
GENERATE_FIELDS = (("regex", "regex"), ("json_schema", "json_schema"), ("ebnf", "grammar"))
SAMPLING_FIELDS = tuple(key for _, key in GENERATE_FIELDS)  # the constraint's, in SamplingParams


def constraint_param(fields: Any, sampling_field: str, prefix: str = "") -> str:
    """The request field that held the constraint SamplingParams got as `sampling_field`
    (named in its errors): `response_format`, or the /generate field after `prefix`."""
    if getattr(fields, "response_format", None) is not None:
        return "response_format"
    return prefix + next(name for name, key in GENERATE_FIELDS if key == sampling_field)


def grammar_param(fields: Any, prefix: str = "") -> str | None:
    """`constraint_param` of the constraint the request has, or None."""
    kw = grammar_kwargs(fields)
    key = next((k for k in SAMPLING_FIELDS if k in kw), None)
    return None if key is None else constraint_param(fields, key, prefix)


def grammar_kwargs(fields: Any) -> dict[str, Any]:
    """SamplingParams keywords from a request's fields (an object with any of the /generate
    fields or `response_format`). Raises ValueError naming the field."""
    kw = {
        key: getattr(fields, name)
        for name, key in GENERATE_FIELDS
        if getattr(fields, name, None) is not None
    }
    rf = getattr(fields, "response_format", None)
    if rf is not None:
        kw.update(response_format_kwargs(rf))
    return kw


def response_format_kwargs(rf: Any) -> dict[str, Any]:
    allowed = 'must be {"type": "text" | "json_object" | "json_schema"}'
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ValueError(f"invalid response_format: {allowed}")
    kind = rf["type"]
    extra = set(rf) - {"type", "json_schema"}
    if extra or (kind != "json_schema" and "json_schema" in rf):
        raise ValueError(
            f"invalid response_format: unknown fields {sorted(extra) or ['json_schema']}"
        )
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"grammar": JSON_OBJECT_EBNF}
    if kind != "json_schema":
        raise ValueError(f"invalid response_format type {kind!r}: {allowed}")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
        raise ValueError(
            'invalid response_format: "json_schema" must be an object with a "schema" '
            "(a JSON schema object)"
        )
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise ValueError(f"invalid response_format.json_schema: unknown fields {sorted(unknown)}")
    schema = spec["schema"]
    return {"json_schema": schema if isinstance(schema, dict) else str(schema).lower()}
