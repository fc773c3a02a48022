"""The program suite's accounting (bench_programs): configs send the same calls, the optimum
bounds the achieved hit rate, radix reaches it on a chain program; its DSL and scheduler
additions (gen's logit_bias, the random policy)."""

from __future__ import annotations

import json

import pytest

from benchmarks.programs.accounting import Call, replay, same_calls
from benchmarks.stack_sampler import summary as stack_summary
from radixrt.sampling import SamplingParams


def test_replay_counts_what_a_perfect_cache_serves():
    a = Call("gen", (1, 2, 3, 4), 3, 3, (5, 6, 7))
    # the next turn extends a's prompt and output; a's last output token has no KV
    b = Call("gen", (1, 2, 3, 4, 5, 6, 7, 8), 1, 7, (9,))
    score = Call("score", (1, 2, 9), 0, 1)  # capped at logprob_start_len - 1
    r = replay([a, b, score])
    assert r.prompt_tokens == 4 + 8 + 3
    assert r.optimal_cached_tokens == 0 + 6 + 1
    assert r.unique_tokens == 6 + 2 + 1  # a: 1-6, b: 7-8, the score: 9
    # history is served before and not counted
    assert replay([b], [a]).optimal_cached_tokens == 6
    assert replay([b], [a]).prompt_tokens == 8
    hint = Call("hint", (1, 2), 0, 1)
    assert same_calls([a, hint, b], [b, a]) and not same_calls([a], [b])


def test_suite_smoke_two_configs(tmp_path):
    """Two configs on the smoke size of a chain, a fork and a select program: the same calls
    everywhere, achieved <= optimal, and radix on an ample pool equals the optimum on the
    chain program (chat) and comes within 10% of it on the others."""
    from benchmarks import bench_programs

    programs = "chat-short,skeleton-of-thought,hellaswag"
    bench_programs.main(["--size", "smoke", "--programs", programs, "--configs",
                         "radix,blockhash", "--latency-programs", "1", "--device", "cpu",
                         "--out", str(tmp_path), "--tag", "t",
                         "--sample-stacks", str(tmp_path / "stacks.json")])  # fmt: skip
    with open(tmp_path / "t.json") as f:
        rows = {(r["program"], r["config"]): r for r in json.load(f)["rows"]}
    assert len(rows) == 6
    with open(tmp_path / "stacks.json") as f:  # every concurrent run was sampled
        stacks = json.load(f)
    assert set(stacks["ticks"]) == {f"{c}/{p}" for p, c in rows}
    main_thread = [s for p, t, s, n in stacks["samples"] if t == "MainThread"]
    assert main_thread and all("run_config@runner.py" in s for s in main_thread)
    text = stack_summary(str(tmp_path / "stacks.json"), "radix/hellaswag", "MainThread", top=500)
    assert text.startswith("radix/hellaswag, MainThread: ") and "run_config" in text
    assert (tmp_path / "t.md").exists() and (tmp_path / "t.png").exists()
    for r in rows.values():
        assert r["same_calls"], r
        assert r["prompt_tokens"] == r["recorded_prompt_tokens"], r
        assert r["cached_tokens"] <= r["optimal_hit_rate"] * r["prompt_tokens"] + 1e-6, r
        assert r["prompt_tokens_computed"] == r["prompt_tokens"] - r["cached_tokens"], r
        assert r["programs_per_s"] > 0 and r["latency_s"] > 0
    assert rows["chat-short", "radix"]["hit_over_optimal"] == 1.0
    for p in ("skeleton-of-thought", "hellaswag"):
        assert rows[p, "radix"]["hit_over_optimal"] >= 0.9
        assert rows[p, "radix"]["hit_rate"] >= rows[p, "blockhash"]["hit_rate"]
    assert rows["chat-short", "radix"]["calls"] == 12  # 4 users x 3 turns
    assert rows["hellaswag", "radix"]["calls"] == 8 * 4  # one score per ending


def test_gen_logit_bias_forces_a_token(tiny_model_dir):
    from radixrt.frontend import Runtime, function, gen
    from radixrt.frontend.backends.http import sampling_json

    @function
    def prog(s):
        s += "Once upon a time" + gen("x", max_tokens=5, temperature=0, ignore_eos=True,
                                      logit_bias={266: 100.0})  # fmt: skip

    with Runtime(tiny_model_dir, device="cpu") as backend:
        state = prog.run(backend=backend)
    assert state.meta("x")["output_ids"] == [266] * 5
    params = gen("y", logit_bias={3: -1.5}).params.resolve(None)
    assert params.logit_bias == ((3, -1.5),)
    assert sampling_json(params)["logit_bias"] == {"3": -1.5}
    with pytest.raises(ValueError, match="logit_bias"):
        gen("z", logit_bias={3: 1000.0})


def test_random_policy_is_a_reproducible_permutation():
    from radixrt.scheduler.policy import order_waiting
    from radixrt.scheduler.request import Request

    waiting = [Request(f"r{i}", 3, [1, 2, 3], SamplingParams(), 4) for i in range(20)]
    order = order_waiting(waiting, "random", lambda r: None, 0.0)
    assert sorted(r.rid for r in order) == sorted(r.rid for r in waiting)
    assert order != waiting
    assert order == order_waiting(waiting, "random", lambda r: None, 0.0)


def test_scripted_runner_simulates_the_in_process_configs(tmp_path):
    """--runner scripted: the suite without a model sends the dry run's calls (the forced
    tokens come back), skips the program that needs a grammar, and radix reaches the optimum
    on a chain program with an ample pool."""
    from benchmarks import bench_programs

    configs = ("radix", "no-hints", "no-admission")
    bench_programs.main(["--size", "smoke", "--programs", "chat-short,json,react", "--configs",
                         ",".join(configs), "--latency-programs", "1", "--runner", "scripted",
                         "--sim-step-s", "0", "--sim-token-s", "1e-6", "--out", str(tmp_path),
                         "--tag", "s"])  # fmt: skip
    with open(tmp_path / "s.json") as f:
        rows = {(r["program"], r["config"]): r for r in json.load(f)["rows"]}
    assert set(rows) == {(p, c) for p in ("chat-short", "react") for c in configs}
    assert all(r["same_calls"] for r in rows.values())
    assert rows["chat-short", "radix"]["hit_over_optimal"] == 1.0


def test_repeat_reports_the_median_run_and_the_spread(tmp_path):
    """--repeat 3: every run is a row; the table and targets use one row per (program,
    config), the median run, with all runs' programs/s and their spread."""
    from benchmarks import bench_programs
    from benchmarks.programs.report import median_rows

    bench_programs.main(["--size", "smoke", "--programs", "chat-short", "--configs",
                         "radix,blockhash", "--latency-programs", "1", "--runner", "scripted",
                         "--sim-step-s", "0", "--sim-token-s", "1e-6", "--out", str(tmp_path),
                         "--tag", "r", "--repeat", "3"])  # fmt: skip
    with open(tmp_path / "r.json") as f:
        results = json.load(f)
    assert len(results["rows"]) == 6
    medians = {r["config"]: r for r in results["medians"]}
    assert set(medians) == {"radix", "blockhash"}
    for config, row in medians.items():
        runs = sorted(r["programs_per_s"] for r in results["rows"] if r["config"] == config)
        assert sorted(row["programs_per_s_runs"]) == runs
        assert row["programs_per_s"] == runs[1]
        assert row["spread"] == pytest.approx((runs[2] - runs[0]) / runs[1])
    rows = [{"program": "p", "config": "c", "programs_per_s": x} for x in (4.0, 1.0, 2.0, 3.0)]
    (only,) = median_rows(rows)
    assert only["programs_per_s"] == 2.0 and only["spread"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="--repeat"):
        bench_programs.main(["--size", "smoke", "--programs", "chat-short", "--configs",
                             "dsl-http", "--repeat", "2", "--out", str(tmp_path)])  # fmt: skip


def test_run_resets_the_cache_after_the_warmup_releases_its_holds(tiny_model_dir):
    """The warm-up program's holds are released through the engine thread's queue: the
    cache reset before the timed run must come after that release, or the held path stays
    cached and the run hits it beyond its optimum (which replays from an empty cache). Here
    the release is slow; a reset that overtakes it leaves the warm-up's context behind."""
    import argparse
    import threading

    from benchmarks.programs import PROGRAMS
    from benchmarks.programs.runner import CONFIGS, Plan, run_config
    from benchmarks.programs.scripted import scripted_engine
    from benchmarks.programs.text import Words

    spec = PROGRAMS["mmlu"]  # one forced gen per program, held while the program runs
    engine = scripted_engine(tiny_model_dir, 0, 0.0, block_size=16)
    words = Words(engine.tokenizer)
    inputs = spec.inputs(words, "smoke", 0, 0, 4)
    warmup = spec.inputs(words, "smoke", 1, 0, 1)  # shares the header's first words
    plan = Plan(spec, inputs, [], warmup, [], 0, 0)

    reset, release = engine.cache.reset, engine.core.release_cache_hold
    resetting = threading.Event()

    def slow_reset() -> None:
        resetting.set()
        reset()

    def slow_release(rid: str) -> bool:
        resetting.wait(timeout=1.0)  # a reset from another thread goes first
        return release(rid)

    engine.cache.reset, engine.core.release_cache_hold = slow_reset, slow_release
    row = run_config(CONFIGS["radix"], plan, engine, argparse.Namespace(max_concurrency=4), [])
    optimal = row["optimal_hit_rate"] * row["recorded_prompt_tokens"]
    assert row["prompt_tokens"] == row["recorded_prompt_tokens"]
    assert row["cached_tokens"] <= optimal, row
    assert engine.allocator.num_used == 0
    engine.shutdown()


def test_engine_warmup_covers_batch_shapes_within_the_context():
    from benchmarks.bench_programs import warmup_prompts

    for max_len in (64, 2048, 8192):
        prompts = warmup_prompts(max_len)
        lengths = [len(p) for p in prompts]
        assert max(lengths) <= max_len // 2 and min(lengths) >= 1
        if max_len >= 2048:
            assert len(set(lengths)) > len(prompts) // 2  # spread, not one shape
        shared = [p for p in prompts[1::2] if len(p) > len(prompts[1]) // 2]
        assert len({tuple(p[:8]) for p in shared}) == 1  # one prefix behind half of them
