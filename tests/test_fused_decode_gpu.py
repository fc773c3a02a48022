"""Whole steps with the fused Triton layer ops (RoPE + KV store in one kernel, Triton add +
RMSNorm and SiLU-and-mul) against FlashInfer's unfused ones, on the tiny checkpoint in bf16
on CUDA: the same greedy tokens (a divergence only at a near tie of the unfused run's top two
tokens), and the log-probs of every generated token (decode steps in CUDA graphs) and of the
prompt (prefill) within bf16 tolerance."""

from __future__ import annotations

import pytest
import torch

from radixrt import SamplingParams
from radixrt.model.layer_ops import FUSED_OPS_ENV, FusedRopeStoreOps, ModuleOps, RopeStoreOps

pytestmark = pytest.mark.gpu

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "A",
    "Question: what is the capital of France? Answer:",
]
MAX_TOKENS = 24
LOGPROB_TOL = 3e-2  # nats: bf16 activations rounded in a different order
GAP_TOL = 0.05  # nats: top-two tokens closer than this are a tie at bf16 precision


def _engine(make_engine, monkeypatch, ops: str, **options):
    monkeypatch.setenv(FUSED_OPS_ENV, ops)  # read when the engine builds its model
    options.setdefault("enable_cuda_graph", True)
    return make_engine(
        device="cuda",
        dtype="bfloat16",
        num_kv_blocks=512,
        attention_backend="flashinfer",
        **options,
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize(
    ("ops", "ops_type"), [("triton", FusedRopeStoreOps), ("triton-rope", RopeStoreOps)]
)
def test_fused_ops_match_unfused(make_engine, monkeypatch, kv_cache_dtype, ops, ops_type):
    if kv_cache_dtype == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 KV needs compute capability >= 8.9")
    ref = _engine(make_engine, monkeypatch, "flashinfer", kv_cache_dtype=kv_cache_dtype)
    fused = _engine(make_engine, monkeypatch, ops, kv_cache_dtype=kv_cache_dtype)
    assert type(ref.core.runner.model.ops) is ModuleOps
    assert type(fused.core.runner.model.ops) is ops_type
    assert fused.core.runner.cuda_graphs is not None
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    ids = [ref.tokenizer.encode(p) for p in PROMPTS]
    want = ref.generate(prompt_token_ids=ids, sampling_params=params)
    got = fused.generate(prompt_token_ids=ids, sampling_params=params)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        first = next(
            (j for j, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b), MAX_TOKENS
        )
        if first < MAX_TOKENS:  # only at a near tie of the unfused run's two best tokens
            (_, lp0), (_, lp1) = w.top_logprobs[first]
            assert abs(lp0 - lp1) < GAP_TOL, f"prompt {i}: tokens differ at {first}, no tie"
        torch.testing.assert_close(
            torch.tensor(g.logprobs[:first]),
            torch.tensor(w.logprobs[:first]),
            rtol=0,
            atol=LOGPROB_TOL,
        )
    prompt_params = SamplingParams(max_tokens=1, prompt_logprobs=True, logprob_start_len=1)
    want = ref.generate(prompt_token_ids=ids, sampling_params=prompt_params)
    got = fused.generate(prompt_token_ids=ids, sampling_params=prompt_params)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(
            torch.tensor(g.prompt_logprobs),
            torch.tensor(w.prompt_logprobs),
            rtol=0,
            atol=LOGPROB_TOL,
        )


def test_fused_decode_graphs_match_eager_fused_steps(make_engine, monkeypatch):
    """The fused ops captured in the decode CUDA graphs give the eager fused forward's
    greedy tokens and log-probs."""
    graphed = _engine(make_engine, monkeypatch, "triton")
    eager = _engine(make_engine, monkeypatch, "triton", enable_cuda_graph=False)
    assert graphed.core.runner.cuda_graphs is not None and eager.core.runner.cuda_graphs is None
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    ids = [graphed.tokenizer.encode(p) for p in PROMPTS]
    with_graphs = graphed.generate(prompt_token_ids=ids, sampling_params=params)
    without = eager.generate(prompt_token_ids=ids, sampling_params=params)
    for a, b in zip(with_graphs, without, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-2
        )


def _decode_plan(runner, num_rows: int, context: int, block_size: int):
    """One decode step of `num_rows` rows over `context` cached tokens each (consecutive
    blocks from 0), slot i for row i."""
    from radixrt.plan import PlanRow, SlotEntry, StepPlan

    gen = torch.Generator().manual_seed(num_rows)
    blocks = -(-(context + 1) // block_size)
    rows = [
        PlanRow(
            rid=f"r{i}",
            slot=i,
            start=context,
            num_tokens=1,
            input_ids=[int(torch.randint(0, 100, (1,), generator=gen))],
            new_blocks=list(range(i * blocks, (i + 1) * blocks)),
            sample_offsets=[0],
        )
        for i in range(num_rows)
    ]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runner.enter_slots([SlotEntry(i, 1, greedy) for i in range(num_rows)])
    return StepPlan(0, rows)


@pytest.mark.parametrize("num_rows", [300, 520])
def test_decode_graphs_past_256_rows_match_eager(tiny_model_dir, monkeypatch, num_rows):
    """Buckets past 256 rows (272.. by 16, 544.. by 32) replay the eager step's logits, with
    every bucket's logits in one shared buffer."""
    from radixrt.config import ModelConfig, resolve_config
    from radixrt.executor.runner import ModelRunner

    monkeypatch.setenv(FUSED_OPS_ENV, "triton")
    block_size, context = 16, 40
    blocks = num_rows * -(-(context + 1) // block_size)
    cfg = resolve_config(
        tiny_model_dir,
        device="cuda",
        dtype="bfloat16",
        attention_backend="flashinfer",
        enable_cuda_graph=True,
        num_kv_blocks=blocks + 1,
        block_size=block_size,
        max_running_requests=num_rows,
        max_model_len=256,
    )
    runner = ModelRunner(cfg, ModelConfig.from_pretrained(tiny_model_dir), 256, num_rows)
    graphs = runner.cuda_graphs
    assert graphs is not None and graphs.max_batch_size >= num_rows
    assert graphs.bucket(num_rows) - num_rows < 32
    # one output buffer: every bucket's logits are rows of the largest one's
    largest = graphs.logits[graphs.max_batch_size]
    assert all(t.data_ptr() == largest.data_ptr() for t in graphs.logits.values())
    gen = torch.Generator(device="cuda").manual_seed(0)
    for layer_kv in runner.pool.kv:  # a random cached context
        layer_kv.copy_(torch.rand(layer_kv.shape, generator=gen, device="cuda") * 2 - 1)
    plan = _decode_plan(runner, num_rows, context, block_size)
    graphed = runner.logits(plan, use_cuda_graph=True).clone()
    eager = runner.logits(plan, use_cuda_graph=False)
    assert graphed.shape == eager.shape == (num_rows, runner.model_cfg.vocab_size)
    err = ((graphed - eager).norm() / eager.norm()).item()
    assert err < 1e-2, err
    assert (graphed.argmax(-1) == eager.argmax(-1)).float().mean() > 0.95
