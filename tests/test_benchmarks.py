"""Benchmarks: workload generators, the dispatcher, the in-process and HTTP runners."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `benchmarks` is a top-level folder, not part of the package
    sys.path.insert(0, ROOT)

from benchmarks.dispatch import Dispatcher  # noqa: E402
from benchmarks.engine_driver import run_engine  # noqa: E402
from benchmarks.workloads import FIRST_TOKEN, WORKLOADS, make_workload  # noqa: E402

TINY_SHARED_PREFIX = dict(num_groups=3, prompts_per_group=4, system_len=48, question_len=8,
                          output_len=4)  # fmt: skip


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_deterministic_and_in_vocab(name):
    a = make_workload(name, "smoke", seed=3, vocab_size=500)
    assert a == make_workload(name, "smoke", seed=3, vocab_size=500)
    assert a != make_workload(name, "smoke", seed=4, vocab_size=500)
    ids = [t for p in a.programs for c in p.calls for t in c.input_ids]
    assert min(ids) >= FIRST_TOKEN and max(ids) < 500
    scaled = make_workload(name, "smoke", scale=2.0, seed=3, vocab_size=500)
    assert len(scaled.programs) == 2 * len(a.programs)


def test_shared_prefix_full_size_structure_and_best_hit_rate():
    w = make_workload("shared-prefix", "full", vocab_size=128256)
    assert len(w.programs) == 1024
    prompts = [p.calls[0].input_ids for p in w.programs]
    assert {len(p) for p in prompts} == {2048 + 128}
    assert {p.calls[0].max_tokens for p in w.programs} == {256}
    for g in range(64):
        group = prompts[16 * g : 16 * g + 16]
        assert len({p[:2048] for p in group}) == 1  # one system prompt per group
        assert len({p[2048:] for p in group}) == 16  # distinct questions
    assert prompts[0][:2048] != prompts[16][:2048]
    assert w.best_hit_rate() == pytest.approx(64 * 15 * 2048 / (1024 * 2176))  # 88.2%


def test_workload_structure_full_size():
    chat = make_workload("multi-turn", "full")
    for p in chat.programs:
        assert len(p.calls) >= 4
        assert [c.parent for c in p.calls] == [None, 0, 1, 2][: len(p.calls)] + list(
            range(3, len(p.calls) - 1)
        )
        assert all(c.max_tokens in (8, 256) for c in p.calls)
        assert all(256 <= len(c.input_ids) <= 512 for c in p.calls[1:])
    assert {c.max_tokens for p in chat.programs for c in p.calls} == {8, 256}
    agent = make_workload("agent", "full")
    assert all(len(p.calls) >= 10 for p in agent.programs)
    assert len({len(c.input_ids) for p in agent.programs for c in p.calls[1:]}) > 10
    tot = make_workload("tree-of-thought", "full")
    for p in tot.programs:
        kids = p.children()
        depth = [0] * len(p.calls)
        for i, c in enumerate(p.calls[1:], 1):
            depth[i] = depth[c.parent] + 1
        assert max(depth) == 2
        assert all(len(kids[i]) in (3, 4) for i in range(len(p.calls)) if depth[i] < 2)
    shots = make_workload("few-shot", "full")
    first = [p.calls[0] for p in shots.programs]
    assert len({c.input_ids[: 5 * 128] for c in first}) == 8  # one 5-shot prefix per subject
    assert all(c.max_tokens == 0 for c in first)
    assert all(not c.extends_output and c.max_tokens <= 1 for p in shots.programs
               for c in p.calls[1:])  # fmt: skip
    assert make_workload("random", "full").best_hit_rate() < 1e-3  # a first token may repeat


def test_dispatcher_chains_prompts_and_limits_concurrency():
    w = make_workload("multi-turn", "smoke", vocab_size=300)
    d = Dispatcher(w, max_concurrency=2)
    ready = d.pop_ready(0.0)
    assert [(c.program, c.index) for c in ready] == [(0, 0), (1, 0)]
    assert d.next_arrival() is None  # both slots taken
    first = ready[0]
    out = list(range(20, 20 + first.max_tokens))
    d.finish(first, out)
    (second,) = d.pop_ready(0.0)
    call = w.programs[0].calls[1]
    assert second.prompt == first.prompt + out + list(call.input_ids)
    with pytest.raises(RuntimeError, match="output tokens"):
        d.finish(second, out[:1] if second.max_tokens != 1 else [])
    # Trees: children only after their parent, all at once; select skips the output.
    tree = make_workload("tree-of-thought", "smoke", vocab_size=300)
    d = Dispatcher(tree)
    roots = d.pop_ready(0.0)
    assert len(roots) == len(tree.programs) and not d.pop_ready(0.0)
    d.finish(roots[0], [11] * roots[0].max_tokens)
    kids = d.pop_ready(0.0)
    assert len(kids) in (3, 4) and all(k.prompt[: len(roots[0].prompt)] == roots[0].prompt
                                       for k in kids)  # fmt: skip
    shots = make_workload("few-shot", "smoke", vocab_size=300)
    d = Dispatcher(shots)
    root = d.pop_ready(0.0)[0]
    d.finish(root, [])
    choices = d.pop_ready(0.0)
    assert len(choices) == 4
    for k, c in zip(choices, shots.programs[0].calls[1:]):
        assert k.prompt == root.prompt + list(c.input_ids)


def test_dispatcher_request_rate_paces_programs():
    w = make_workload("random", "smoke", vocab_size=300)
    d = Dispatcher(w, request_rate=10.0, seed=1)
    assert 0 < d.next_arrival() < 2
    assert d.pop_ready(0.0) == []
    assert len(d.pop_ready(d.arrivals[3])) == 4


def test_inprocess_run_all_configs(make_engine, one_thread):
    w = make_workload("shared-prefix", "smoke", vocab_size=2000, **TINY_SHARED_PREFIX)
    hit = {}
    for cache, policy in [("radix", "lpm"), ("blockhash", "fcfs"), ("none", "fcfs")]:
        engine = make_engine(prefix_cache=cache, policy=policy)
        result = run_engine(engine, w)
        assert result.complete and len(result.records) == w.num_calls
        assert sum(r.output_tokens for r in result.records) == w.output_tokens
        assert all(len(r.token_times) == 4 and r.first_token >= r.submit for r in result.records)
        engine.check_integrity()  # run_engine checks this too; make_engine again at teardown
        assert engine.allocator.num_used == engine.cache.cached_blocks  # no request holds KV
        engine.cache.reset()
        assert engine.allocator.num_used == 0
        hit[cache] = sum(r.cached_tokens for r in result.records) / w.prompt_tokens
    assert hit["radix"] >= hit["blockhash"] >= hit["none"] == 0
    assert hit["radix"] == pytest.approx(w.best_hit_rate())  # all arrive at once: in-batch dedup


def test_bench_serving_cli_writes_results(tmp_path, tiny_model_dir, one_thread):
    from benchmarks import bench_serving

    argv = ["--model", tiny_model_dir, "--device", "cpu", "--size", "smoke", "--workloads",
            "random", "--pressure", "", "--scale", "0.125", "--out", str(tmp_path),
            "--tag", "t", "--repeat", "2", "--order", "workload"]  # fmt: skip
    bench_serving.main(argv)
    results = json.loads((tmp_path / "t.json").read_text())
    runs = results["runs"]
    assert [r["config"] for r in runs] == ["radix+lpm", "blockhash+fcfs", "none+fcfs"]
    assert len(results["all_runs"]) == 6
    assert all(r["complete"] and r["num_calls"] == 4 and r["output_tokens"] == 128 for r in runs)
    assert all(len(r["repeat_durations_s"]) == 2 for r in runs)
    for r in runs:  # of two runs, the shorter is the (low) median
        assert r["duration_s"] == min(r["repeat_durations_s"])
        a, b = r["repeat_durations_s"]
        assert r["duration_spread"] == pytest.approx(abs(a - b) / min(a, b))
    assert (tmp_path / "t.png").stat().st_size > 0
    assert "| random | radix+lpm |" in (tmp_path / "t.md").read_text()


def test_agent_steps_as_tool_calls(make_engine, one_thread):
    """With tool_calls, every step after the first appends the call's closing, the tool
    message around the observation and the next call's opening (template text shared by
    every agent); the radix cache reuses the whole history of each step."""
    from benchmarks.bench_serving import parse_args, plan_runs

    plain = make_workload("agent", "smoke", vocab_size=2000)
    w = make_workload("agent", "smoke", 0.5, vocab_size=2000, tool_calls=True, num_steps=3)
    assert w.params["tool_calls"] and not plain.params.get("tool_calls")
    steps = [c.input_ids for p in w.programs for c in p.calls[1:]]
    assert len({s[:17] for s in steps}) == 1  # the closing and the result's opening
    assert all(c.input_ids[-6:] == steps[0][-6:] for p in w.programs for c in p.calls)
    result = run_engine(make_engine(prefix_cache="radix", policy="lpm"), w)
    assert result.complete and len(result.records) == w.num_calls
    hit = sum(r.cached_tokens for r in result.records) / w.prompt_tokens
    assert hit == pytest.approx(w.best_hit_rate(), abs=0.02)
    args = parse_args(["--size", "smoke", "--workloads", "agent", "--pressure", "",
                       "--agent-tool-calls"])  # fmt: skip
    assert plan_runs(args, vocab_size=2000, max_len=2048)[0].workload.params["tool_calls"]


def test_bench_serving_retention_hints_per_run(tmp_path, tiny_model_dir, one_thread):
    """--tool-pause-s reaches the agent workload; --cache-ttl-s runs each value on the same
    engine (a row per hint, named by it); hints on the server backend are refused."""
    from benchmarks import bench_serving

    argv = ["--model", tiny_model_dir, "--device", "cpu", "--size", "smoke", "--workloads", "",
            "--pressure", "agent", "--scale", "agent=0.5", "--tool-pause-s", "0.01",
            "--cache-ttl-s", "0,5", "--configs", "radix", "--out", str(tmp_path),
            "--tag", "t"]  # fmt: skip
    bench_serving.main(argv)
    runs = json.loads((tmp_path / "t.json").read_text())["runs"]
    assert [(r["config"], r["cache_ttl_s"]) for r in runs] == [
        ("radix+lpm", 0.0),
        ("radix+lpm+ttl5", 5.0),
    ]
    assert all(r["complete"] and r["workload_params"]["tool_pause_s"] == 0.01 for r in runs)
    assert runs[0]["prompt_tokens"] == runs[1]["prompt_tokens"]  # the same calls
    with pytest.raises(ValueError, match="--backend engine"):
        bench_serving.parse_ttls("0,5", "server")
    with pytest.raises(ValueError, match="cache-ttl-s"):
        bench_serving.parse_ttls("-1", "engine")


def test_plan_runs_pressure_pool():
    from benchmarks.bench_serving import parse_args, plan_runs

    args = parse_args(["--size", "smoke", "--workloads", "random", "--pressure", "multi-turn"])
    runs = plan_runs(args, vocab_size=2000, max_len=2048)
    assert [r.label for r in runs][0] == "random" and runs[0].num_kv_blocks is None
    pressured = runs[1]
    blocks = pressured.workload.working_set_tokens() / 16
    assert pressured.label.startswith("multi-turn@kv/")
    assert pressured.num_kv_blocks == pytest.approx(blocks / 3, abs=1)
    with pytest.raises(ValueError, match="context"):
        plan_runs(args, vocab_size=2000, max_len=128)


@pytest.mark.parametrize("cumulative", [True, False], ids=["sglang-streams", "incremental"])
def test_http_driver_against_fake_server(cumulative):
    """SSE parsing, metrics polling and session chaining, against a stand-in server that
    streams SGLang's cumulative output_ids or deltas (--incremental-streaming-output),
    sometimes two tokens per event."""
    from aiohttp import web

    from benchmarks.http_driver import run_server

    seen: list[list[int]] = []

    async def generate(request):
        body = await request.json()
        ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        seen.append(ids)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        out, sent = [FIRST_TOKEN + i for i in range(n)], 0
        while sent < n:
            new = out[sent : sent + 1 + sent % 2]
            sent += len(new)
            meta = {"prompt_tokens": len(ids), "cached_tokens": len(ids) // 2,
                    "completion_tokens": sent,
                    "finish_reason": {"type": "length"} if sent == n else None}  # fmt: skip
            shown = out[:sent] if cumulative else new
            event = {"text": "x", "output_ids": shown, "meta_info": meta}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(request):
        text = "radixrt_kv_blocks_total 100.0\nradixrt_kv_blocks_free 90.0\n"
        return web.Response(text=text + "radixrt_kv_blocks_in_use 7.0\n")

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/metrics", metrics)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        w = make_workload("multi-turn", "smoke", scale=0.125, vocab_size=300)  # 2 users
        result = run_server(f"http://127.0.0.1:{port}", w, max_concurrency=1)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    assert result.complete and len(result.records) == w.num_calls == len(seen)
    calls = w.programs[0].calls
    out = [FIRST_TOKEN + i for i in range(calls[0].max_tokens)]
    assert seen[1] == seen[0] + out + list(calls[1].input_ids)  # turn 2 extends turn 1
    assert result.kv.peak_blocks_used == 10 and result.kv.peak_blocks_active == 7
    assert result.kv.preemptions is None  # no /debug/state
    rec = result.records[0]
    assert rec.cached_tokens == rec.prompt_tokens // 2 and rec.output_tokens == len(out)


def test_bench_spec_rerun_is_drafted_from_the_tree(make_engine, one_thread):
    """bench_spec's pass: counters over the pass; a re-run agent is drafted from the radix
    tree on every decode row and gives the same outputs as no speculation."""
    from benchmarks.bench_spec import run_pass, table

    w = make_workload("agent", "smoke", 0.1, vocab_size=2000, num_steps=3, system_len=16,
                      task_len=8, action_len=6, observation_len=(4, 8))  # fmt: skip
    rows, outs = [], {}
    for method in ("none", "radix"):
        engine = make_engine(speculative_method=method, num_speculative_tokens=4)
        for run in (1, 2):
            row, outs[method, run] = run_pass(engine, w)
            rows.append({**row, "workload": "agent", "method": method, "run": run,
                         "same_outputs": outs[method, run] == outs["none", run]})  # fmt: skip
    assert all(r["output_tokens"] == w.output_tokens and r["same_outputs"] for r in rows)
    radix1, radix2 = rows[2], rows[3]
    assert radix1["spec_proposals"] > 0 and radix2["fire_rate"] == 1.0
    assert radix2["acceptance_rate"] == 1.0 and radix2["steps"] < rows[1]["steps"]
    assert "| agent | 2 | radix |" in table(rows)


def test_bench_timeline_counts_every_step(tiny_model_dir, one_thread, capsys):
    from benchmarks import bench_timeline

    bench_timeline.main(["--model", tiny_model_dir, "--device", "cpu", "--size", "smoke",
                         "--scale", "0.25"])  # fmt: skip
    out = capsys.readouterr().out
    assert "| decode |" in out and "GPU busy" in out
    steps = int(out.split(" steps")[0].rsplit(", ", 1)[1])
    table = [line.split("|") for line in out.splitlines() if line.startswith("| ") and
             line.split("|")[1].strip() in ("decode", "mixed", "prefill")]  # fmt: skip
    assert sum(int(r[2]) for r in table) == steps


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_bench_fork_tiny_peak_equals_prediction(one_thread, overlap):
    """benchmarks/bench_fork.py on the tiny model (CPU): n = W, beam W and W independent
    requests; the measured peak of KV blocks equals the design's count (main() asserts it);
    forks share the prompt's full blocks, beams share and copy."""
    from benchmarks.bench_fork import blocks_of_beams, main

    # 47 + 18 - 1 = 64 positions: a sequence ends exactly at a block boundary
    rows = main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--overlap", overlap,
                 "--prompt-len", "47", "--output-len", "18", "--width", "3"])  # fmt: skip
    by = {r["case"]: r for r in rows}
    assert by["independent"]["peak_blocks"] == 3 * 4
    assert by["n"]["peak_blocks"] == 2 + 3 * 2  # (47 - 1) // 16 shared, 2 own per child
    assert by["n"]["fork_shared_blocks"] == 2 * 2 and by["n"]["fork_copied_blocks"] == 2
    assert by["beam"]["beam_steps"] == 18 and by["beam"]["peak_blocks"] < 12
    # the beam rule on sequences made up here: shared up to the first difference // B
    assert blocks_of_beams([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], 2) == 1 + 1 + 2  # d = 4
    assert blocks_of_beams([[1, 2, 3, 4], [9, 2, 3, 4]], 2) == 4


@pytest.mark.gpu
def test_bench_fork_gpu_tiny_peak_equals_prediction():
    """The same on CUDA (overlap on, FlashInfer or the GPU backend, copy ops on the device)."""
    from benchmarks.bench_fork import main

    rows = main(["--model", "tiny", "--device", "cuda", "--prompt-len", "100",
                 "--output-len", "29", "--width", "4"])  # fmt: skip
    assert {r["case"] for r in rows} == {"n", "beam", "independent"}


def test_retention_hints_target_agents_with_tool_pauses_at_a_third_of_the_working_set():
    """The retention target in the scheduler simulation (virtual time, no host tier), engine
    defaults: agents pausing 0.2 s per tool call, the pool a third of the working set; with
    `cache_ttl_s` the prompt tokens recomputed are at most 0.75x those of plain LRU."""
    from benchmarks.bench_scheduler import simulate

    w = make_workload("agent", size="full", scale=0.25, vocab_size=2048, tool_pause_s=0.2)
    pool = math.ceil(math.ceil(w.working_set_tokens() / 16) / 3)
    runs = {ttl: simulate(w, "radix", "lpm", pool, 16, 0, ttl, 5.0, 0.001) for ttl in (0.0, 5.0)}
    assert runs[0.0]["recomputed"] > 0
    assert runs[5.0]["recomputed"] <= 0.75 * runs[0.0]["recomputed"]


def test_mixed_traffic_holds_only_for_the_first_workload():
    """`interleave` spreads the second workload's programs evenly among the first's; with
    `holds` only the first's calls ask for retention holds (the engine's hold counter), and
    the simulation times the other programs' calls apart."""
    from benchmarks.bench_scheduler import simulate
    from benchmarks.workloads import interleave

    agents = make_workload("agent", size="smoke", scale=0.5, vocab_size=2048)
    other = make_workload("multi-turn", size="smoke", scale=0.25, vocab_size=2048, seed=1)
    mixed, holds = interleave(agents, other)
    assert len(mixed.programs) == len(agents.programs) + len(other.programs) == len(holds)
    assert [p for p, h in zip(mixed.programs, holds) if h] == list(agents.programs)
    assert [p for p, h in zip(mixed.programs, holds) if not h] == list(other.programs)
    assert holds[0] and not all(holds[: len(holds) // 2])  # spread, not appended
    asks = sum(len(p.calls) - sum(not k for k in p.children()) for p in agents.programs)
    counts = {}
    for mask in (holds, None):
        r = simulate(mixed, "radix", "lpm", 4096, 16, 0, 5.0, math.inf, 0.001, holds=mask,
                     retention_max_share=1.0)  # fmt: skip
        counts[mask is None] = r["retention_holds"]
        assert (r["other_e2e_mean_s"] > 0) == (mask is not None)
    assert counts[False] == asks  # the agents' calls that a later call extends
    assert counts[True] > asks  # the chats' turns too
