"""benchmarks.bench_lora_engine on the tiny model (CPU): every cell it was asked for, ratios
to the base, adapters that change the outputs, swap-ins that really swap (no timing asserted)."""

from __future__ import annotations

import json

SWAPS = 2  # --swap-iters


def test_lora_engine_bench_smoke(tiny_model_dir, tmp_path, capsys):
    from benchmarks.bench_lora_engine import main

    path = tmp_path / "lora.json"
    main(["--model", "tiny", "--device", "cpu", "--adapters", "0,2", "--ranks", "8",
          "--batches", "4", "--context", "16", "--warmup", "2", "--iters", "3",
          "--serve-requests", "4", "--serve-prompt", "16", "--serve-output", "4",
          "--swap-iters", str(SWAPS), "--json", str(path)])  # fmt: skip
    results = json.loads(path.read_text())

    decode = {(r["rank"], r["adapters"], r["batch"]): r for r in results["decode"]}
    assert set(decode) == {(None, 0, 4), (8, 2, 4)}
    for r in decode.values():
        assert r["ms_per_step"] > 0 and r["tok_per_s"] > 0 and r["vs_base"] > 0, r
    assert decode[None, 0, 4]["vs_base"] == 1.0

    serve = {(r["rank"], r["adapters"]): r for r in results["serve"]}
    assert set(serve) == {(None, 0), (8, 2)}
    for r in serve.values():
        assert r["requests"] == 4 and r["output_tok_s"] > 0 and r["vs_base"] > 0, r
    # the adapters' deltas are real: greedy outputs move (the base run equals itself)
    assert serve[None, 0]["changed_vs_base"] == 0
    assert serve[8, 2]["changed_vs_base"] > 0

    swap = {r["source"]: r for r in results["swap"]}
    assert set(swap) == {"disk", "host"}
    for r in swap.values():
        assert r["rank"] == 8 and len(r["ms_all"]) == SWAPS and r["ms"] > 0, r
    lora = next(e for e in results["engines"] if e["rank"] == 8)
    # 2 adapters on first use, then SWAPS read from disk and SWAPS back from the host cache
    assert lora["swaps_in"] == 2 + 2 * SWAPS and lora["host_reads"] == 2 + SWAPS, lora

    out = capsys.readouterr().out
    assert "## Multi-LoRA decode" in out and "## Multi-LoRA serving" in out
    assert out.rstrip().splitlines()[-1].startswith("| 8 | 2 | host | 2 |")  # a table comes last
