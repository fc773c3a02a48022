"""Engine options, declared once: a config dataclass field made with `option(...)` carries its
help, choices and flag, and the command line's flags (`add_flags`), the keyword arguments they
give (`given_options`) and docs/api.md's option table (`markdown_table`; `radixrt
options-table` rewrites it) are generated from it.

A flag that is not given passes nothing, so `radixrt serve` with no flags configures the same
engine as `Engine(model)`: the field's default, or for an `auto` option what
`radixrt.config.resolve_config` picks."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Option:
    """How a config field is offered to users."""

    help: str  # one line per meaning; docs/api.md's table shows it whole
    flags: tuple[str, ...] = ()  # default: `--<name>`; a bool's `--disable-*` flag stores False
    choices: tuple[str, ...] | None = None
    auto: bool = False  # unset: resolve_config picks the value (the help says how)
    unit: tuple[str, int] | None = None  # the flag's unit and its factor (e.g. ("MiB", 2**20))
    cli: bool = True  # False: an engine keyword only (or a flag of `serve`: see `doc_flag`)
    doc_flag: str | None = None  # the table's flag column where it is not the generated one
    doc_default: str | None = None  # the table's default column where the value says too little


def option(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field whose default is `default`, offered to users as `Option(help, **kw)`."""
    return field(default=default, metadata={"option": Option(help, **kw)})


def declared(config_cls: type) -> Iterator[tuple[dataclasses.Field, Option]]:
    """Every option field of `config_cls` and of its nested config dataclasses, in order."""
    for f in dataclasses.fields(config_cls):
        opt = f.metadata.get("option")
        if opt is not None:
            yield f, opt
        elif dataclasses.is_dataclass(f.default_factory):  # a nested config
            yield from declared(f.default_factory)


def _flags(f: dataclasses.Field, opt: Option) -> tuple[str, ...]:
    return opt.flags or ("--" + f.name.replace("_", "-"),)


def _is_bool(f: dataclasses.Field) -> bool:
    return f.type in ("bool", bool)


def _is_list(f: dataclasses.Field) -> bool:
    """A `tuple[str, ...]` field: its flag takes one or more values."""
    return str(f.type).startswith("tuple[")


def _value_type(f: dataclasses.Field, opt: Option):
    if opt.unit is not None:
        return float
    kind = str(f.type).split("|")[0].strip()
    return {"int": int, "float": float}.get(kind, str)


def _shown_default(f: dataclasses.Field, opt: Option) -> str:
    if opt.doc_default is not None:
        return opt.doc_default
    if opt.auto:
        return "auto"
    value = f.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if opt.unit is not None:
        return f"{value / opt.unit[1]:g} {opt.unit[0]}"
    return str(value)


def add_flags(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """One flag per command-line option of `config_cls` (nested configs included)."""
    group = parser.add_argument_group("engine")
    for f, opt in declared(config_cls):
        if not opt.cli:
            continue
        help_text = f"{opt.help} (default: {_shown_default(f, opt)})".replace("%", "%%")
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if _is_bool(f):
            kw["action"] = (
                "store_false" if _flags(f, opt)[0].startswith("--disable") else "store_true"
            )
        else:
            kw["type"] = _value_type(f, opt)
            if _is_list(f):
                kw["nargs"] = "+"
            if opt.unit is not None:
                kw["metavar"] = opt.unit[0]
            if opt.choices is not None:
                kw["choices"] = (*opt.choices, "auto") if opt.auto else opt.choices
        group.add_argument(*_flags(f, opt), **kw)


def given_options(args: argparse.Namespace, config_cls: type) -> dict[str, Any]:
    """The engine keyword arguments of the flags given on the command line ("auto" passes
    nothing: resolve_config picks)."""
    out: dict[str, Any] = {}
    for f, opt in declared(config_cls):
        if not opt.cli or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if opt.auto and value == "auto":
            continue
        if _is_list(f):
            value = tuple(value)
        out[f.name] = int(value * opt.unit[1]) if opt.unit is not None else value
    return out


def markdown_table(config_cls: type) -> str:
    """docs/api.md's option table."""
    rows = ["| option | flag | default | meaning |", "|---|---|---|---|"]
    for f, opt in declared(config_cls):
        if opt.doc_flag is not None:
            flag = opt.doc_flag
        elif opt.cli:
            flag = ", ".join(f"`{x}`" for x in _flags(f, opt))
        else:
            flag = "-"
        rows.append(f"| `{f.name}` | {flag} | {_shown_default(f, opt)} | {opt.help} |")
    return "\n".join(rows) + "\n"


DOC_BEGIN = "<!-- options table: generated from radixrt/config.py by `radixrt options-table` -->\n"
DOC_END = "<!-- end of options table -->\n"


def write_doc_table(path: str, config_cls: type) -> bool:
    """Rewrite the option table between the markers of `path` (docs/api.md); True if it
    changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, _, rest = text.partition(DOC_BEGIN)
    _, _, tail = rest.partition(DOC_END)
    new = head + DOC_BEGIN + markdown_table(config_cls) + DOC_END + tail
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text
