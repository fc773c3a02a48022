"""The command line's engine options default to the engine's own defaults: `radixrt serve`
with no flags configures the same engine as `Engine(model)` (every default is declared in
radixrt.config; a flag's default that drifted from it would make the two differ)."""

from __future__ import annotations

import argparse
import dataclasses


def _differences(a, b, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x):
            out += _differences(x, y, f"{prefix}{f.name}.")
        elif x != y:
            out.append(f"{prefix}{f.name}: command line {x!r}, engine {y!r}")
    return out


def test_cli_engine_defaults_are_the_engine_defaults(tiny_model_dir):
    from radixrt.cli import _engine_args, engine_options
    from radixrt.config import resolve_config

    p = argparse.ArgumentParser()
    _engine_args(p)
    options = engine_options(p.parse_args([]))
    assert "retention_max_share" in options and "kv_cache_dtype" in options
    from_cli = resolve_config(tiny_model_dir, **{**options, "device": "cpu"})
    assert _differences(from_cli, resolve_config(tiny_model_dir, device="cpu")) == []
