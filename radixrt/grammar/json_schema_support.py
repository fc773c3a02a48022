"""Which JSON-schema keywords structured output enforces, and the check that refuses the
others (plain Python, no xgrammar).

xgrammar (0.2.x) builds its grammar from a subset of JSON Schema and ignores the rest, so a
keyword it ignores would let the output break the schema the client sent. `check_json_schema`
refuses, before compiling, every keyword in `UNSUPPORTED_KEYWORDS`, a `format` outside
`SUPPORTED_FORMATS`, `multipleOf` on anything but an integer and `allOf` with more than one
subschema, naming the keyword and its place in the schema as a JSON pointer. It also applies
the regex limits of `radixrt.grammar.regex_limits` to every `pattern`.

Enforced (`SUPPORTED_KEYWORDS`): type (a name or a list), enum, const; properties, required,
additionalProperties, patternProperties, propertyNames, minProperties, maxProperties,
unevaluatedProperties; items, prefixItems, unevaluatedItems, minItems, maxItems; minimum,
maximum, exclusiveMinimum, exclusiveMaximum, multipleOf (integers); minLength, maxLength,
pattern, format (`SUPPORTED_FORMATS`); anyOf, oneOf (as anyOf: output matches at least one
subschema), allOf with one subschema; $ref to #/$defs or #/definitions.
Annotations (`ANNOTATION_KEYWORDS`, e.g. title, description, default) constrain nothing and
are accepted; so are keywords JSON Schema does not define (they are annotations too).
"""

from __future__ import annotations

from typing import Any

from radixrt.grammar.regex_limits import check_regex

# keyword -> where its subschemas are: "schema" (one), "map" (name -> schema), "list"
_SUBSCHEMAS = {
    "properties": "map",
    "patternProperties": "map",
    "$defs": "map",
    "definitions": "map",
    "additionalProperties": "schema",
    "unevaluatedProperties": "schema",
    "propertyNames": "schema",
    "items": "schema",  # a list: the older tuple form
    "unevaluatedItems": "schema",
    "prefixItems": "list",
    "anyOf": "list",
    "oneOf": "list",
    "allOf": "list",
}
SUPPORTED_KEYWORDS = frozenset(
    {
        *_SUBSCHEMAS,
        "type", "enum", "const", "required", "minProperties", "maxProperties", "minItems",
        "maxItems", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "minLength", "maxLength", "pattern", "format", "$ref",
    }
)  # fmt: skip
ANNOTATION_KEYWORDS = frozenset(
    {
        "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
        "$schema", "$id", "$anchor", "$comment", "$vocabulary", "contentEncoding",
        "contentMediaType", "contentSchema",
    }
)  # fmt: skip
# JSON Schema validation keywords xgrammar does not enforce: refused wherever they appear
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not", "if", "then", "else", "contains", "minContains", "maxContains", "uniqueItems",
        "dependentRequired", "dependentSchemas", "dependencies", "additionalItems",
        "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor",
    }
)  # fmt: skip
SUPPORTED_FORMATS = frozenset(
    {
        "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
        "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
# keyword values that are allowed although the keyword is in UNSUPPORTED_KEYWORDS: they
# constrain nothing
_NO_OP_VALUES = {"uniqueItems": (False,), "minContains": (), "maxContains": ()}


def check_json_schema(schema: Any, what: str = "json_schema") -> None:
    """Raise ValueError naming the first keyword of `schema` (a parsed JSON value) that
    structured output cannot enforce, with its JSON pointer; `what` names the field."""
    _check(schema, "", what)


def _check(schema: Any, path: str, what: str) -> None:
    if not isinstance(schema, dict):
        return  # true / false, or a malformed value the compile reports
    for key, value in schema.items():
        where = f"{path}/{_escape(key)}"
        if key in UNSUPPORTED_KEYWORDS and value not in _NO_OP_VALUES.get(key, ()):
            _refuse(what, f'"{key}"', where, "structured output cannot enforce it")
        if key == "format" and isinstance(value, str) and value not in SUPPORTED_FORMATS:
            _refuse(what, f'"format": "{value}"', where, "an unknown format is not enforced")
        if key == "multipleOf" and schema.get("type") != "integer":
            _refuse(what, '"multipleOf"', where, 'only {"type": "integer"} schemas enforce it')
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            _refuse(what, '"allOf"', where, "only an allOf of one subschema is enforced")
        if key == "pattern" and isinstance(value, str):
            check_regex(value, f"{what} pattern at {where or '/'}")
        kind = _SUBSCHEMAS.get(key)
        if kind == "schema" or (kind == "list" and isinstance(value, list)):
            for i, sub in enumerate(value) if isinstance(value, list) else [(None, value)]:
                _check(sub, where if i is None else f"{where}/{i}", what)
        elif kind == "map" and isinstance(value, dict):
            for name, sub in value.items():
                if key == "patternProperties":
                    check_regex(name, f"{what} patternProperties key at {where}")
                _check(sub, f"{where}/{_escape(name)}", what)


def _refuse(what: str, keyword: str, where: str, why: str) -> None:
    raise ValueError(
        f"unsupported {what} keyword {keyword} at {where}: {why}; structured output enforces "
        f"{', '.join(sorted(SUPPORTED_KEYWORDS))}"
    )


def _escape(key: str) -> str:
    """A JSON-pointer reference token (RFC 6901)."""
    return str(key).replace("~", "~0").replace("/", "~1")
