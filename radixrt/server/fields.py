"""What the schemas declare, put to use: neutral fields checked at their accepted values,
names no schema declares found in a body (ignored with one warning each, or refused under
--strict-fields), and the field lists the tests and docs derive from the schemas."""

from __future__ import annotations

import functools
import logging
import re
import typing
from typing import Any

import msgspec

from radixrt.server.protocol import ApiError, decode
from radixrt.server.schemas import NEUTRAL

logger = logging.getLogger("radixrt.server")


class NeutralField(typing.NamedTuple):
    name: str  # the JSON name
    accepted: tuple[object, ...]  # the values radixrt accepts (the upstream defaults)
    why: str  # what radixrt lacks to honour another value


@functools.cache
def neutral_fields(schema: type[msgspec.Struct]) -> tuple[NeutralField, ...]:
    """The fields of `schema` declared with `schemas.neutral(...)`."""
    hints = typing.get_type_hints(schema, include_extras=True)
    out = []
    for name in schema.__struct_fields__:
        for meta in getattr(hints[name], "__metadata__", ()):
            extra = getattr(meta, "extra", None) or {}
            if NEUTRAL in extra:
                out.append(NeutralField(name, extra[NEUTRAL], extra["why"]))
    return tuple(out)


@functools.cache
def nested_schemas(schema: type[msgspec.Struct]) -> dict[str, type[msgspec.Struct]]:
    """Field name -> the struct a field holds (itself, in a list, or optional)."""
    out = {}
    for f in msgspec.inspect.type_info(schema).fields:
        t = f.type
        if isinstance(t, msgspec.inspect.UnionType):
            kinds = [
                k
                for k in t.types
                if isinstance(k, (msgspec.inspect.StructType, msgspec.inspect.ListType))
            ]
            t = kinds[0] if kinds else t
        if isinstance(t, msgspec.inspect.ListType):
            t = t.item_type
        if isinstance(t, msgspec.inspect.StructType):
            out[f.encode_name] = t.cls
    return out


@functools.cache  # unknown_names asks once per object of a request (1.5 M messages: 50 MB)
def field_names(schema: type[msgspec.Struct]) -> tuple[str, ...]:
    """Every JSON name `schema` declares (the fuzz test and docs list these)."""
    return tuple(f.encode_name for f in msgspec.inspect.type_info(schema).fields)


def check_neutral(obj: msgspec.Struct, prefix: str = "") -> None:
    """ApiError (400, naming the field) for a neutral field set to a value radixrt cannot
    honour, in `obj` and the structs it holds."""
    for f in neutral_fields(type(obj)):
        value = getattr(obj, f.name)
        if not any(value == a and type(value) is type(a) for a in f.accepted):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            accepted = " or ".join("null" if a is None else repr(a) for a in f.accepted)
            raise ApiError(
                f"{prefix}{f.name}={shown} is not supported ({f.why}); accepted: {accepted}",
                param=prefix + f.name,
            )
    for name in nested_schemas(type(obj)):
        value = getattr(obj, name)
        if isinstance(value, msgspec.Struct):
            check_neutral(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, msgspec.Struct):
                    check_neutral(item, f"{prefix}{name}[{i}].")


_raw_object = msgspec.json.Decoder(dict[str, msgspec.Raw])
_raw_list = msgspec.json.Decoder(list[msgspec.Raw])


def unknown_names(body: bytes | msgspec.Raw, schema: type[msgspec.Struct]) -> list[str]:
    """Dotted names in the JSON object `body` that `schema` does not declare (a body that
    decoded as `schema`, so every declared nested object is an object)."""
    try:
        obj = _raw_object.decode(body)
    except msgspec.DecodeError:  # not an object: nothing to name
        return []
    known = set(field_names(schema))
    nested = nested_schemas(schema)
    out = [name for name in obj if name not in known]
    for name, sub in nested.items():
        raw = obj.get(name)
        if raw is None:
            continue
        text = bytes(raw)
        if text[:1] == b"{":
            out += [f"{name}.{n}" for n in unknown_names(raw, sub)]
        elif text[:1] == b"[":
            for i, item in enumerate(_raw_list.decode(raw)):
                if bytes(item)[:1] == b"{":
                    out += [f"{name}[{i}].{n}" for n in unknown_names(item, sub)]
    return out


# unknown names remembered (and logged once each) at most: clients choose the names
MAX_WARNED_NAMES = 1024


class UnknownFields:
    """What a route does with names its schema does not declare: ignore them with one
    warning per name (`strict` False, vLLM's behaviour), or refuse the request (400 naming
    the first)."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._warned: set[str] = set()  # "route: name" already warned about

    def check(self, body: bytes, schema: type[msgspec.Struct], route: str) -> None:
        names = unknown_names(body, schema)
        if not names:
            return
        if self.strict:
            raise ApiError(
                f"unknown field {names[0]}: {route} does not define it (--strict-fields)",
                param=names[0],
            )
        for name in names:
            key = f"{route}: {_generic(name)}"
            if key not in self._warned and len(self._warned) < MAX_WARNED_NAMES:
                self._warned.add(key)
                logger.warning("ignoring field %s of %s: no schema defines it", name, route)
                if len(self._warned) == MAX_WARNED_NAMES:
                    logger.warning(
                        "%d unknown field names seen: no more are logged", len(self._warned)
                    )


def _generic(name: str) -> str:
    """messages[3].x -> messages[].x (one warning whichever message has it)."""
    return re.sub(r"\[\d+\]", "[]", name)


LENIENT = UnknownFields()


def decode_checked(
    body: bytes, schema: type[Any], route: str, unknown: UnknownFields = LENIENT
) -> Any:
    """The body as `schema` (ApiError naming the field for a wrong type), its unknown
    names handled by `unknown`, its neutral fields checked."""
    req = decode(body, schema)
    unknown.check(body, schema, route)
    check_neutral(req)
    return req


class FieldDoc(typing.NamedTuple):
    name: str  # the JSON name (nested: "stream_options.include_usage")
    type: str  # the JSON type, as msgspec's JSON schema spells it
    range: str | None  # a static integer range ("[0, 64]"); model-dependent ones: validate
    default: object  # the value when absent
    accepted: tuple[object, ...] | None  # neutral: the only values accepted; None: any


def field_docs(schema: type[msgspec.Struct], prefix: str = "") -> list[FieldDoc]:
    """One row per field of `schema` and of the structs it holds (docs/api.md's tables)."""
    neutral = {f.name: f.accepted for f in neutral_fields(schema)}
    _, defs = msgspec.json.schema_components([schema])
    props = defs[schema.__name__].get("properties", {})
    nested = nested_schemas(schema)
    rows = []
    for f in msgspec.inspect.type_info(schema).fields:
        prop = props.get(f.encode_name, {})
        parts = prop.get("anyOf", [prop])
        kind = " | ".join(str(p.get("type", p.get("$ref", "any"))).split("/")[-1] for p in parts)
        bounds = [(p["minimum"], p.get("maximum")) for p in parts if "minimum" in p]
        lo, hi = bounds[0] if bounds else (None, None)
        span = None if lo is None else f"[{lo}, {'inf' if hi is None else hi}]"
        default = None if f.default is msgspec.NODEFAULT else f.default
        if f.default_factory is not msgspec.NODEFAULT:
            default = "{}"
        rows.append(FieldDoc(prefix + f.encode_name, kind, span, default, neutral.get(f.name)))
        if f.encode_name in nested and nested[f.encode_name] is not schema:
            rows += field_docs(nested[f.encode_name], f"{prefix}{f.encode_name}.")
    return rows
