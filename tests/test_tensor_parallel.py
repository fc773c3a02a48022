"""Tensor parallelism on a CPU with gloo (2 ranks, float32): the same greedy tokens and
log-probs as one rank with overlap on and off, chunked prefill, preemption and the prefix
cache; ranks sample alike; the loader reads each rank's slice; bad sizes are rejected before
any process starts; a dead rank 0 leaves no worker behind (a dead worker: see
test_tensor_parallel_gqa.py).

Worker processes are started once per engine fixture (module scope): variants of the
scheduler configuration run as EngineCores over the same TensorParallelRunner."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest
import torch

from radixrt import Engine, SamplingParams
from radixrt.config import ModelConfig
from radixrt.engine.core import EngineCore
from radixrt.model import LlamaForCausalLM, build_model
from radixrt.model.loader import iterate_hf_weight_slices
from radixrt.model.tiny import EOS_IDS
from radixrt.tp_shard import TPShard, check_devices

B = 4  # block size: matches end mid-block
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
PROMPTS = [
    [5, 6, 7, 8, 9, 10],
    [11, 12, 13] * 9,
    list(range(20, 75)),
    [7, 100, 200, 300, 400, 500, 600, 700, 800, 900, 999],
]


@pytest.fixture(scope="module")
def tp_engine(tiny_model_dir):
    engine = Engine(
        tiny_model_dir, device="cpu", dtype="float32", tensor_parallel_size=2, block_size=B
    )
    yield engine
    workers = engine_workers(engine)
    engine.shutdown()
    assert workers and all(p.poll() == 0 for p in workers)  # STOP: a clean exit


def engine_workers(engine) -> list[subprocess.Popen]:
    return engine.core.runner.workers.procs if engine.core.runner else []


def core_over(engine, num_kv_blocks: int | None = None, **scheduler) -> EngineCore:
    """A fresh EngineCore (scheduler, cache) over `engine`'s runner, with `scheduler` /
    cache / overlap options replaced; `num_kv_blocks` < the pool's makes the allocator
    hand out only that many blocks (memory pressure)."""
    cfg = engine.config
    top = {k: scheduler.pop(k) for k in ("overlap_schedule",) if k in scheduler}
    cache = {k: scheduler.pop(k) for k in ("prefix_cache",) if k in scheduler}
    cfg = dataclasses.replace(
        cfg,
        cache=dataclasses.replace(cfg.cache, **cache),
        scheduler=dataclasses.replace(cfg.scheduler, **scheduler),
        **top,
    )
    runner = engine.core.runner
    blocks = num_kv_blocks or runner.num_usable_blocks
    return EngineCore(cfg, engine.model_config, EOS_IDS, runner=runner, num_kv_blocks=blocks)


def run_core(core: EngineCore, prompts, params) -> list[tuple[list[int], list[float]]]:
    rids = [core.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    lps: dict[str, list[float]] = {r: [] for r in rids}
    while core.has_work:
        for d in core.step():
            tokens[d.rid] += d.new_token_ids
            lps[d.rid] += d.new_logprobs
    core.check_integrity()
    return [(tokens[r], lps[r]) for r in rids]


def assert_same(got, want) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "options",
    [
        {"overlap_schedule": False},
        {"overlap_schedule": True},
        {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},  # chunked prefill
        {"overlap_schedule": True, "max_num_batched_tokens": 24, "prefix_cache": "none"},
    ],
    ids=["sync", "overlap", "chunked", "overlap-chunked-nocache"],
)
def test_greedy_same_as_one_rank(tp_engine, make_engine, options):
    one = make_engine(block_size=B)
    want = run_core(core_over(one, **options), PROMPTS, GREEDY)
    got = run_core(core_over(tp_engine, **options), PROMPTS, GREEDY)
    assert_same(got, want)


def test_preemption_same_as_one_rank(tp_engine, make_engine):
    """Too few KV blocks for all requests at once: requests are preempted and recomputed
    the same way on one rank and on two."""
    cores = [core_over(e, num_kv_blocks=24) for e in (make_engine(block_size=B), tp_engine)]
    want, got = (run_core(core, PROMPTS, GREEDY) for core in cores)
    assert_same(got, want)
    assert cores[1].stats()["preemptions"] == cores[0].stats()["preemptions"] > 0


def test_prefix_cache_multi_turn(tp_engine, make_engine):
    """Turns that extend the previous turn's prompt + output: the same tokens as one rank
    and the same cache hits (the radix cache runs on rank 0 only; the workers' KV follows
    the plans)."""
    one = make_engine(block_size=B)
    cores = {"one": core_over(one, overlap_schedule=True), "tp": core_over(tp_engine)}
    history = {k: [list(p) for p in PROMPTS[:2]] for k in cores}
    for turn in range(3):
        outs = {}
        for k, core in cores.items():
            outs[k] = run_core(core, history[k], GREEDY)
            history[k] = [h + t + [50 + turn] for h, (t, _) in zip(history[k], outs[k])]
        assert_same(outs["tp"], outs["one"])
    assert cores["tp"].stats()["cached_tokens"] == cores["one"].stats()["cached_tokens"] > 0


def test_ranks_sample_alike(tp_engine, make_engine):
    """Random sampling: every rank holds the same last samples (unseeded rows draw from
    a generator seeded alike on each rank); seeded rows match one rank's tokens."""
    core = core_over(tp_engine, overlap_schedule=True)
    run_core(core, PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True))
    assert tp_engine.core.runner.compare_last_tokens()
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    want = run_core(core_over(make_engine(block_size=B)), PROMPTS, seeded)
    assert [t for t, _ in run_core(core, PROMPTS, seeded)] == [t for t, _ in want]
    assert tp_engine.core.runner.compare_last_tokens()


def test_engine_api_and_kv_pool_per_rank(tp_engine, make_engine):
    """The public Engine with tensor_parallel_size=2; rank 0's pool holds its KV heads."""
    outs = tp_engine.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    want = make_engine(block_size=B).generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    pool = tp_engine.core.runner.local.pool
    assert pool.num_kv_heads == tp_engine.model_config.num_kv_heads // 2
    assert tp_engine.config.tensor_parallel_size == 2


def test_loader_reads_each_rank_slice(tiny_model_dir):
    """Each rank's parameters, read through safetensors slices, are exactly its part of
    the full model's (merged) parameters; together the ranks hold all of them."""
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    full = dict(
        build_model(
            cfg, tiny_model_dir, device="cpu", dtype="float32", load_format="auto", max_positions=64
        ).named_parameters()
    )
    qkv = full["layers.1.self_attn.qkv_proj.weight"]
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
    for rank in range(2):
        shard = TPShard.of(cfg, rank, 2)
        model = LlamaForCausalLM(cfg, 64, shard, group=object())  # no collective runs here
        model.load_weights(iterate_hf_weight_slices(tiny_model_dir))
        got = dict(model.named_parameters())
        hq, hkv = shard.q_size, shard.kv_size
        want_qkv = torch.cat(
            [
                q[rank * hq : (rank + 1) * hq],
                k[rank * hkv : (rank + 1) * hkv],
                v[rank * hkv :][:hkv],
            ]
        )
        torch.testing.assert_close(got["layers.1.self_attn.qkv_proj.weight"], want_qkv)
        o = full["layers.1.self_attn.o_proj.weight"]
        torch.testing.assert_close(
            got["layers.1.self_attn.o_proj.weight"], o[:, rank * hq :][:, :hq]
        )
        inter = shard.intermediate_size
        gate, up = full["layers.0.mlp.gate_up_proj.weight"].chunk(2)
        torch.testing.assert_close(
            got["layers.0.mlp.gate_up_proj.weight"],
            torch.cat([gate[rank * inter :][:inter], up[rank * inter :][:inter]]),
        )
        emb = got["embed_tokens.weight"]
        real = shard.vocab_end - shard.vocab_start
        torch.testing.assert_close(
            emb[:real], full["embed_tokens.weight"][shard.vocab_start :][:real]
        )
        assert not emb[real:].any()  # padding rows
        torch.testing.assert_close(got["norm.weight"], full["norm.weight"])


def test_shard_arithmetic():
    base = dict(architecture="LlamaForCausalLM", vocab_size=1001, hidden_size=64)
    cfg = ModelConfig(**base, intermediate_size=96, num_layers=1, num_heads=8, num_kv_heads=2,
                      head_dim=8)  # fmt: skip
    shards = [TPShard.of(cfg, r, 4) for r in range(4)]
    assert [s.kv_head_start for s in shards] == [0, 0, 1, 1]  # 2 KV heads replicated on 4
    assert all(s.num_kv_heads == 1 and s.num_heads == 2 for s in shards)
    assert [s.checkpoint_range("q_proj") for s in shards][3] == (0, 48, 64)
    assert shards[3].checkpoint_range("v_proj") == (0, 8, 16)
    assert shards[1].checkpoint_range("down_proj") == (1, 24, 48)
    assert shards[0].checkpoint_range("input_layernorm") is None
    assert [s.vocab_per_rank for s in shards][0] == 251  # ceil(1001 / 4)
    assert shards[3].checkpoint_range("embed_tokens") == (0, 753, 1001)
    split = TPShard.of(cfg, 1, 2)
    assert (split.num_kv_heads, split.kv_head_start) == (1, 1)


@pytest.mark.parametrize(
    "size, message",
    [(4, "does not divide the model's 6 attention heads"), (0, "must be an integer >= 1")],
)
def test_bad_sizes_rejected_before_any_process(tiny_model_dir, size, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_model_dir, device="cpu", tensor_parallel_size=size)
    kv = ModelConfig("LlamaForCausalLM", 64, 64, 64, 1, num_heads=12, num_kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="one must divide the other"):
        TPShard.of(kv, 0, 6)
    with pytest.raises(ValueError, match="needs CUDA devices 0..3, but 2 are visible"):
        check_devices("cuda", 4, 2)
    with pytest.raises(ValueError, match="needs CUDA devices 1..2"):
        check_devices("cuda:1", 2, 2)
    check_devices("cuda", 2, 2)
    check_devices("cpu", 8, 0)


def test_cli_option():
    import argparse

    from radixrt.cli import _engine_args, engine_options

    p = argparse.ArgumentParser()
    _engine_args(p)
    assert engine_options(p.parse_args(["--tp", "2"]))["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in engine_options(p.parse_args([]))  # the engine's default


RANK0_SCRIPT = """
import sys, time
from radixrt import Engine, SamplingParams
engine = Engine(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2))
print(engine.core.runner.workers.procs[0].pid, flush=True)
time.sleep(600)
"""


def test_workers_exit_when_rank0_dies(tiny_model_dir):
    """SIGKILL the engine's process (rank 0): its worker exits by itself (its pipe to rank 0
    reads end-of-file), within seconds."""
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK0_SCRIPT, tiny_model_dir],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        worker_pid = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while _alive(worker_pid):
        assert time.monotonic() < deadline, f"worker {worker_pid} outlived rank 0"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as gone: it is only waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_plan_codec_round_trip():
    """Every PlanRow field the ranks read, slot entries, block ops and side tables survive;
    the request id and waits_for_result (scheduler bookkeeping) are not sent."""
    from radixrt.executor.tp.plan_codec import ControlKind, PlanDecoder, PlanEncoder
    from radixrt.plan import (
        CopyBlock,
        PlanRow,
        PromptLogprobs,
        SlotEntry,
        StepPlan,
        SwapIn,
        SwapOut,
        TokenBitmasks,
    )

    shared = SamplingParams(temperature=0.5, top_k=3, stop=("x",), seed=4, logprobs=True)
    rows = [
        PlanRow("", 1, 5, 1, [], True, 1, [9], [0], 0, 3),
        PlanRow(
            "", 2, 0, 6, [1, 2, 3, 4], False, 0, [3, 4], [3, 4, 5], 2, 0, PromptLogprobs(1, [2, 3])
        ),  # fmt: skip
        PlanRow("", 3, 0, 2, [8, 9], sample_offsets=[1]),
    ]
    entries = [
        SlotEntry(1, 5, shared),
        SlotEntry(2, 6, SamplingParams(presence_penalty=0.5), copy_from=1, prompt_ids=[4]),
        SlotEntry(3, 7, SamplingParams(max_tokens=None, top_p=0.5), output_ids=[1, 1]),
    ]
    plan = StepPlan(
        7,
        rows,
        [CopyBlock(1, 2, 3), SwapOut(4, 5), SwapIn(6, 7)],
        new_slots=entries,
        drafts={1: [5, 6]},
        device_drafts=[],
        bitmasks=TokenBitmasks([2], bytes(range(8))),
    )
    enc, dec = PlanEncoder(), PlanDecoder()
    kind, got = dec.decode(enc.encode(plan))
    assert kind == ControlKind.PLAN and got == plan
    plan.rows[0].rid, plan.rows[0].waits_for_result = "a", ["grammar"]
    sent = PlanRow("", 1, 5, 1, [], True, 1, [9], [0], 0, 3)
    assert dec.decode(enc.encode(plan))[1].rows[0] == sent
    assert dec.decode(enc.control(ControlKind.STOP)) == (ControlKind.STOP, None)
