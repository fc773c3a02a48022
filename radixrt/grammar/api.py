"""Structured-output fields of the HTTP API -> SamplingParams keywords (torch-free: the front
imports this).

`/generate` sampling_params: `regex`, `json_schema` (object or string), `ebnf`,
`structural_tag` (xgrammar's, object or string) (SGLang's completions and chat too).
vLLM's `guided_json`, `guided_regex`, `guided_choice` (a regex
alternation of the escaped choices), `guided_grammar`. OpenAI routes:
`response_format` {"type": "text"} | {"type": "json_object"} (any JSON object) |
{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}.
Types and sizes are checked here and by SamplingParams; whether the text compiles is known
only in the scheduler process (a compile error is a 400 from there, whose `param` the front
replaces by `grammar_param`: the field the client used).
"""

from __future__ import annotations

import json
from typing import Any

from radixrt.grammar.spec import JSON_OBJECT_EBNF

# API field -> SamplingParams field
GENERATE_FIELDS = (("regex", "regex"), ("json_schema", "json_schema"), ("ebnf", "grammar"),
                   ("structural_tag", "structural_tag"))  # fmt: skip
# vLLM's structured-output fields (OpenAI routes)
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")

SAMPLING_FIELDS = tuple(key for _, key in GENERATE_FIELDS)  # the constraint's, in SamplingParams


def constraint_param(fields: Any, sampling_field: str, prefix: str = "") -> str:
    """The request field that held the constraint SamplingParams got as `sampling_field`
    (named in its errors): the /generate field of that name when the request set it,
    `response_format.json_schema` for a schema from there, else the field that set a
    constraint (`grammar_param`: response_format, vLLM's guided_*)."""
    name = next(name for name, key in GENERATE_FIELDS if key == sampling_field)
    if getattr(fields, name, None) is not None:
        return prefix + name
    if sampling_field == "json_schema" and getattr(fields, "response_format", None) is not None:
        return "response_format.json_schema"
    given = grammar_param(fields, prefix)
    return given if given is not None else prefix + name


def grammar_kwargs(fields: Any) -> dict[str, Any]:
    """SamplingParams keywords from a request's fields (an object with any of the /generate
    fields or `response_format`). Raises ValueError naming the field."""
    kw = {
        key: getattr(fields, name)
        for name, key in GENERATE_FIELDS
        if getattr(fields, name, None) is not None
    }
    if isinstance(kw.get("structural_tag"), dict):
        kw["structural_tag"] = json.dumps(kw["structural_tag"])
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


# request fields that set structured output, in the order errors name them
GRAMMAR_FIELDS = (
    "regex", "json_schema", "ebnf", "structural_tag", "response_format", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar",
)  # fmt: skip


def grammar_param(f: Any, prefix: str = "") -> str | None:
    """The field of request `f` that set its structured output (None: none did)."""
    rf = getattr(f, "response_format", None)
    text_only = isinstance(rf, dict) and rf.get("type") in (None, "text")
    for name in GRAMMAR_FIELDS:
        if getattr(f, name, None) is not None and not (name == "response_format" and text_only):
            return prefix + name
    return None


def guided_kwargs(f: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """vLLM's guided_* fields of request `f` as SamplingParams keywords; `kw`: the keywords
    the other structured-output fields set. ValueError unless at most one is set."""
    out: dict[str, Any] = {}
    if f.guided_json is not None:
        out["json_schema"] = f.guided_json
    if f.guided_regex is not None:
        out["regex"] = f.guided_regex
    if f.guided_choice is not None:
        if not f.guided_choice or not all(f.guided_choice):
            raise ValueError("guided_choice must be a list of non-empty strings")
        import regex

        out["regex"] = "|".join(regex.escape(c) for c in f.guided_choice)
    if f.guided_grammar is not None:
        out["grammar"] = f.guided_grammar
    given = [k for k in ("regex", "json_schema", "grammar", "structural_tag") if k in kw]
    given += [name for name in GUIDED_FIELDS if getattr(f, name) is not None]
    if len(given) > 1:
        raise ValueError(
            "at most one structured output (response_format, guided_json, guided_regex, "
            "guided_choice, guided_grammar, regex, json_schema, ebnf) per request"
        )
    return out
