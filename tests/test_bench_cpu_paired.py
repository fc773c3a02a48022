"""benchmarks.bench_cpu_paired runs both sides each round (no timing asserted)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_paired_bench_runs_both_each_round(tiny_model_dir, one_thread, capsys):
    from benchmarks.bench_cpu_paired import main

    rows = main(["--rounds", "2", "--threads", "1"])
    assert len(rows) == 2 and all(hf > 0 and rt > 0 for hf, rt in rows)
    out = capsys.readouterr().out
    assert "round 1:" in out and "round 2:" in out and "per-round ratio median" in out
