"""A tool's parameters checked as a JSON schema before anything is compiled: the shape
the grammar compiler needs, with errors that name where in the schema it is wrong."""

from __future__ import annotations

from typing import Any

from radixrt.grammar.json_schema_support import check_json_schema
from radixrt.json_depth import MAX_JSON_DEPTH, value_depth_exceeds
from radixrt.server.protocol import ApiError

TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# keywords whose value is a schema / a map of schemas / a list of schemas
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


def check_schema(schema: Any, param: str) -> None:
    """ApiError (naming `param`) unless `schema` is an object schema: a JSON object with
    `type` "object" (or none), whose nested schemas are objects or booleans with known
    types, `required` a list of names and `enum` a list."""
    if not isinstance(schema, dict):
        raise ApiError(f"{param} must be a JSON schema object", param)
    if value_depth_exceeds(schema):
        raise ApiError(f"{param} is nested more than {MAX_JSON_DEPTH} levels deep", param)
    if schema.get("type", "object") != "object":
        raise ApiError(f'{param}.type must be "object" (the arguments are an object)', param)
    _check(schema, param, param)
    try:  # the keywords the grammar enforces, as for response_format
        check_json_schema(schema, param)
    except ValueError as e:
        raise ApiError(str(e), param) from None


def _check(schema: Any, where: str, param: str) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ApiError(f"{param}: {where} must be a schema (an object or a boolean)", param)
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    bad = [k for k in kinds if not (isinstance(k, str) and k in TYPES)]
    if bad or (isinstance(kind, list) and not kind):
        raise ApiError(
            f"{param}: {where}.type={kind!r} is not a JSON schema type (allowed: "
            f"{', '.join(sorted(TYPES))})",
            param,
        )
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        raise ApiError(f"{param}: {where}.required must be a list of property names", param)
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise ApiError(f"{param}: {where}.enum must be a list", param)
    for key in _ONE:
        if key in schema:
            _check(schema[key], f"{where}.{key}", param)
    for key in _MAP:
        if key in schema:
            sub = schema[key]
            if not isinstance(sub, dict):
                raise ApiError(f"{param}: {where}.{key} must be an object of schemas", param)
            for name, s in sub.items():
                _check(s, f"{where}.{key}.{name}", param)
    for key in _LIST:
        if key in schema:
            sub = schema[key]
            if not isinstance(sub, list) or not sub:
                raise ApiError(f"{param}: {where}.{key} must be a non-empty list of schemas", param)
            for i, s in enumerate(sub):
                _check(s, f"{where}.{key}[{i}]", param)
