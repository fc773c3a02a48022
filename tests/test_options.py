"""Engine options are declared once, in radixrt/config.py: the command line's flags and
docs/api.md's option table are generated from the declarations, and a flag left out passes
nothing, so `radixrt serve` with no flags configures the same engine as `Engine(model)`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from radixrt.cli import _engine_args, engine_options
from radixrt.config import EngineConfig, resolve_config
from radixrt.options import declared, markdown_table

DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    _engine_args(p)
    return p


def _config_fields(cls) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            out += _config_fields(f.default_factory)
        elif f.name != "model_path":
            out.append(f.name)
    return out


def test_every_config_field_is_a_declared_option():
    names = [f.name for f, _ in declared(EngineConfig)]
    assert names == _config_fields(EngineConfig)


def test_no_flag_passes_nothing_and_configures_the_engine_defaults(tiny_model_dir):
    assert engine_options(_parser().parse_args([])) == {}
    # ... and "auto" for an auto option passes nothing either: resolve_config picks
    assert engine_options(_parser().parse_args(["--policy", "auto", "--dtype", "auto"])) == {}


# a value other than the default for each kind of flag, and where it lands
FLAGS = [
    (["--block-size", "32"], lambda c: c.cache.block_size == 32),
    (["--prefix-cache", "blockhash"], lambda c: c.cache.prefix_cache == "blockhash"),
    (["--policy", "dfs-weight"], lambda c: c.scheduler.policy == "dfs-weight"),
    (["--mem-fraction", "0.5"], lambda c: c.cache.mem_fraction == 0.5),
    (["--tp", "1"], lambda c: c.tensor_parallel_size == 1),
    (["--disable-jump-forward"], lambda c: c.grammar.jump_forward is False),
    (["--jump-forward-retokenize"], lambda c: c.grammar.jump_forward_retokenize is True),
    (["--grammar-cache-mb", "1.5"], lambda c: c.grammar.grammar_cache_bytes == 3 * 2**19),
    (["--speculative-method", "ngram", "--ngram-max-n", "5"], lambda c: c.speculative.ngram_max_n == 5),  # noqa: E501
    (["--retention-max-share", "0.25"], lambda c: c.scheduler.retention_max_share == 0.25),
    (["--kv-events-hash-seed", "7"], lambda c: c.cache.kv_events_hash_seed == "7"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "check"), FLAGS, ids=[a[0] for a, _ in FLAGS])
def test_a_flag_reaches_the_config(argv, check):
    options = engine_options(_parser().parse_args(argv))
    assert check(resolve_config("-", "cpu", **options))


def test_disable_flags_store_false():
    options = engine_options(_parser().parse_args(["--disable-cuda-graph"]))
    assert options == {"enable_cuda_graph": False}
    cfg = resolve_config("-", "cpu", **engine_options(_parser().parse_args([])))
    assert cfg.enable_cuda_graph is False  # CPU: auto resolves to off


def test_choices_come_from_the_declaration():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--prefix-cache", "lru"])


def test_the_docs_table_is_current():
    text = DOCS.read_text()
    assert markdown_table(EngineConfig) in text, "run `radixrt options-table` to update"
