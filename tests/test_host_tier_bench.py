"""Benchmarks with the host KV tier: the radix-host config, the long-history workload and the
host-tier table (tiny model, CPU)."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `benchmarks` is a top-level folder, not part of the package
    sys.path.insert(0, ROOT)

from benchmarks.workloads import DEFAULT_WORKLOADS, make_workload  # noqa: E402


def test_long_history_shape():
    w = make_workload("long-history", "full", vocab_size=128256)
    assert len(w.programs) == 48 and "long-history" not in DEFAULT_WORKLOADS
    for p in w.programs:
        assert 4096 <= len(p.calls[0].input_ids) <= 16384
        assert all(c.max_tokens in (16, 32) for c in p.calls)
        assert [c.parent for c in p.calls] == [None, 0, 1, 2]


def test_bench_serving_host_tier_long_history(tmp_path, tiny_model_dir):
    import torch

    from benchmarks import bench_serving

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        argv = ["--model", tiny_model_dir, "--device", "cpu", "--size", "smoke", "--workloads",
                "", "--pressure", "long-history", "--pressure-factor", "4", "--scale", "0.5",
                "--configs", "radix+fcfs,radix-host+fcfs", "--host-kv-gb", "0.05",
                "--out", str(tmp_path), "--tag", "t"]  # fmt: skip
        bench_serving.main(argv)
    finally:
        torch.set_num_threads(before)
    runs = {r["config"]: r for r in json.loads((tmp_path / "t.json").read_text())["runs"]}
    host, base = runs["radix-host+fcfs"], runs["radix+fcfs"]
    assert host["complete"] and base["complete"]
    assert host["host_hit_tokens"] > 0 and host["host_loaded_blocks"] > 0
    assert host["hit_rate"] > base["hit_rate"]
    assert host["prompt_tokens_computed"] < base["prompt_tokens_computed"]
    assert host["output_tokens"] == base["output_tokens"]
    assert "| radix-host+fcfs |" in (tmp_path / "t.md").read_text()
