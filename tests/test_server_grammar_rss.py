"""The grammar cache's bound holds for the scheduler process: once warm-up has filled the
cache, many more distinct JSON schemas leave the scheduler's RSS (from /proc) flat, and
matchers and masks go with their requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_utils import serving

pytest.importorskip("xgrammar")

CACHE_MB = 48  # the cache under test; warm-up fills it
WARMUP, MEASURED = 150, 250  # distinct schemas (about 0.45 MB each in the process)
MAX_GROWTH_MB = 40  # less than what 100 more cached grammars cost


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def schema(i: int) -> str:
    props = {f"p{i}_{k}": {"type": ["string", "integer", "boolean"][k % 3]} for k in range(30)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def test_scheduler_rss_stays_within_the_grammar_cache_bound(tiny_model_dir):
    with serving(tiny_model_dir, "--grammar-cache-mb", str(CACHE_MB)) as srv:
        pid = srv.state()["scheduler_pid"]

        def run(first: int, count: int) -> None:
            for i in range(first, first + count):
                sp = {"max_new_tokens": 1, "json_schema": schema(i)}
                status, out = srv.post("/generate", {"text": "x", "sampling_params": sp})
                assert status == 200, out

        run(0, WARMUP)
        assert srv.state()["scheduler"]["grammar_cache_evictions"] > 0  # the cache is full
        before = rss_mb(pid)
        run(WARMUP, MEASURED)
        growth = rss_mb(pid) - before
        assert growth < MAX_GROWTH_MB, f"scheduler RSS grew {growth:.0f} MB"
