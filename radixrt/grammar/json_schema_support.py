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
pattern, format (`SUPPORTED_FORMATS`); anyOf, oneOf (compiled as anyOf, so accepted only
where no value can match two subschemas: distinct types, distinct const/enum values, or a
required property of distinct const/enum values), allOf with one subschema; $ref to #/$defs
or #/definitions. minProperties over 1 is refused on objects that take keys beyond their
named properties (the output may repeat such a key, and a repeated key counts once).
Annotations (`ANNOTATION_KEYWORDS`, e.g. title, description, default) constrain nothing and
are accepted; so are keywords JSON Schema does not define (they are annotations too).
"""

from __future__ import annotations

import itertools
import json
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
        if key == "oneOf" and isinstance(value, list) and not _disjoint(value):
            _refuse(what, '"oneOf"', where, _ONE_OF_RULE)
        if key == "minProperties" and _int_over_1(value) and _open_keys(schema):
            _refuse(what, '"minProperties"', where, _MIN_PROPERTIES_RULE)
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


_ONE_OF_RULE = (
    "a value could match more than one of its subschemas (oneOf is enforced only when the "
    "subschemas have distinct types, distinct const/enum values, or are objects with a "
    "required property of distinct const/enum values: use anyOf otherwise)"
)
_MIN_PROPERTIES_RULE = (
    "over 1 where the object takes keys beyond its named properties, which the output may "
    "repeat (a repeated key counts once)"
)


def _int_over_1(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 1


def _open_keys(schema: dict) -> bool:
    """The object may have keys its `properties` do not name (xgrammar's strict mode: only
    where a keyword allows them)."""
    extra = [schema.get(k) for k in ("additionalProperties", "unevaluatedProperties")]
    return any(e is not None and e is not False for e in extra) or bool(
        schema.get("patternProperties") or schema.get("propertyNames")
    )


MAX_ONE_OF_PAIRS = 64  # oneOf subschemas compared pair by pair at most (else all at once)


def _disjoint(branches: list) -> bool:
    """No JSON value matches two of `branches`, by a rule that is simple to check: every
    two differ in type, in const/enum values, or in the const/enum values of a property
    both require."""
    if not all(isinstance(b, dict) for b in branches):
        return False
    if len(branches) > MAX_ONE_OF_PAIRS:  # one pass: all types, or all values, distinct
        kinds = [_types(b) for b in branches]
        return all(k is not None for k in kinds) and _pairwise_disjoint(kinds)
    return all(_apart(a, b) for a, b in itertools.combinations(branches, 2))


def _apart(a: dict, b: dict) -> bool:
    for x, y in [(_types(a), _types(b)), (_values(a), _values(b))]:
        if x is not None and y is not None and not x & y:
            return True
    for name in set(a.get("required") or ()) & set(b.get("required") or ()):
        pa, pb = ((s.get("properties") or {}).get(name) for s in (a, b))
        if isinstance(pa, dict) and isinstance(pb, dict) and _apart(pa, pb):
            return True
    return False


def _types(schema: dict) -> set[str] | None:
    """The JSON types `schema` allows (its `type`, or its const/enum values'), None when
    neither says; an integer is a number too."""
    kind = schema.get("type")
    if kind is None and ("const" in schema or isinstance(schema.get("enum"), list)):
        items = [schema["const"]] if "const" in schema else schema["enum"]
        kinds: list | None = [_type_of(v) for v in items]
    else:
        kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
    if kinds is None or not all(isinstance(k, str) for k in kinds):
        return None
    out = set(kinds)
    return out | {"integer"} if "number" in out else out


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    kinds = {float: "number", str: "string", list: "array", dict: "object"}
    return kinds.get(type(value), "null")


def _values(schema: dict) -> set[str] | None:
    """The values `schema` allows as canonical JSON texts, when it lists them."""
    if "const" in schema:
        items = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        items = schema["enum"]
    else:
        return None
    try:
        return {json.dumps(v, sort_keys=True) for v in items}
    except (TypeError, ValueError):
        return None


def _pairwise_disjoint(sets: list[set[str]]) -> bool:
    return sum(len(x) for x in sets) == len(set().union(*sets))


def _refuse(what: str, keyword: str, where: str, why: str) -> None:
    raise ValueError(
        f"unsupported {what} keyword {keyword} at {where}: {why}; structured output enforces "
        f"{', '.join(sorted(SUPPORTED_KEYWORDS))}"
    )


def _escape(key: str) -> str:
    """A JSON-pointer reference token (RFC 6901)."""
    return str(key).replace("~", "~0").replace("/", "~1")
