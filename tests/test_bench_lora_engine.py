"""benchmarks.bench_lora_engine on the tiny model (CPU): every cell it was asked for, ratios
to the base, adapters that change the outputs, sessions that hit their own adapter's cache and
no other's, swap-ins that really swap (no timing asserted)."""

from __future__ import annotations

import json

import pytest

SWAPS = 2  # --swap-iters
SESSIONS, TURNS, CHUNK, ANSWER = 4, 3, 16, 4  # --sessions, --session-turns, -chunk, -output


def test_lora_engine_bench_smoke(tiny_model_dir, tmp_path, capsys):
    from benchmarks.bench_lora_engine import main

    path = tmp_path / "lora.json"
    main(["--model", "tiny", "--device", "cpu", "--adapters", "0,2", "--ranks", "8",
          "--batches", "4", "--context", "16", "--warmup", "2", "--iters", "3",
          "--serve-requests", "4", "--serve-prompt", "16", "--serve-output", "4",
          "--swap-iters", str(SWAPS), "--sessions", str(SESSIONS),
          "--session-turns", str(TURNS), "--session-chunk", str(CHUNK),
          "--session-output", str(ANSWER), "--json", str(path)])  # fmt: skip
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

    sessions = {(r["rank"], r["adapters"]): r for r in results["sessions"]}
    assert set(sessions) == {(None, 0), (8, 2)}
    # turn t's prompt: (t - 1) earlier turns of history, then CHUNK new tokens
    turns = range(2, TURNS + 1)
    history_share = sum((t - 1) * (CHUNK + ANSWER) for t in turns) / sum(
        (t - 1) * (CHUNK + ANSWER) + CHUNK for t in turns
    )
    for r in sessions.values():
        assert (r["sessions"], r["turns"]) == (SESSIONS, TURNS), r
        assert r["history_share"] == pytest.approx(history_share), r
        # every session reuses its whole history but the last answer token (whose KV no step
        # wrote), in its own adapter's namespace: each adapter's rate is the overall one
        for key in ("hit_rate", "hit_rate_min", "hit_rate_median", "hit_rate_max"):
            assert history_share - 0.05 <= r[key] <= history_share, (key, r)
        assert r["output_tok_s"] > 0 and r["wall_s"] > 0, r
        assert r["own_cached"] == CHUNK - 1, r  # the probe's repeat: all but its last token
    assert sessions[None, 0]["cross_cached"] is None  # the base engine has no other adapter
    assert sessions[8, 2]["cross_cached"] == 0  # the same prompt under another adapter

    swap = {r["source"]: r for r in results["swap"]}
    assert set(swap) == {"disk", "host"}
    for r in swap.values():
        assert r["rank"] == 8 and len(r["ms_all"]) == SWAPS and r["ms"] > 0, r
    lora = next(e for e in results["engines"] if e["rank"] == 8)
    # 2 adapters on first use, then SWAPS read from disk and SWAPS back from the host cache
    assert lora["swaps_in"] == 2 + 2 * SWAPS and lora["host_reads"] == 2 + SWAPS, lora

    out = capsys.readouterr().out
    assert "## Multi-LoRA decode" in out and "## Multi-LoRA serving" in out
    assert "## Multi-LoRA sessions" in out
    assert out.rstrip().splitlines()[-1].startswith("| 8 | 2 | host | 2 |")  # a table comes last
