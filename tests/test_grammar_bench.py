"""benchmarks/bench_grammar.py runs end to end on the tiny model (small sizes)."""

from __future__ import annotations

import json
import subprocess
import sys

from server_utils import REPO


def test_bench_grammar_smoke(tmp_path):
    out = tmp_path / "grammar.json"
    args = ["--iters", "2", "--batch-sizes", "4", "--num-requests", "6", "--max-tokens", "80"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_grammar.py", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    masks = [r for r in rows if r["part"] == "masks"]
    jf = {r["jump_forward"]: r for r in rows if r["part"] == "jump-forward"}
    assert masks and masks[0]["mask_build_ms"] > 0 and masks[0]["mask_apply_ms"] > 0
    assert jf["off"]["forced_tokens"] == 0 < jf["token"]["forced_tokens"]
    assert jf["token"]["generated_tokens"] == jf["off"]["generated_tokens"]
    assert jf["token"]["steps"] < jf["off"]["steps"]
