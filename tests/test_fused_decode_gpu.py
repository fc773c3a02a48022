"""Whole steps with the fused Triton layer ops (RoPE + KV store in one kernel, Triton add +
RMSNorm and SiLU-and-mul) against FlashInfer's unfused ones, on the tiny checkpoint in bf16
on CUDA: the same greedy tokens (a divergence only at a near tie of the unfused run's top two
tokens), and the log-probs of every generated token (decode steps in CUDA graphs) and of the
prompt (prefill) within bf16 tolerance."""

from __future__ import annotations

import pytest
import torch

from radixrt import SamplingParams
from radixrt.model.layer_ops import FUSED_OPS_ENV, FusedRopeStoreOps, ModuleOps

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
def test_fused_ops_match_unfused(make_engine, monkeypatch, kv_cache_dtype):
    if kv_cache_dtype == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 KV needs compute capability >= 8.9")
    ref = _engine(make_engine, monkeypatch, "flashinfer", kv_cache_dtype=kv_cache_dtype)
    fused = _engine(make_engine, monkeypatch, "triton", kv_cache_dtype=kv_cache_dtype)
    assert type(ref.core.runner.model.ops) is ModuleOps
    assert type(fused.core.runner.model.ops) is FusedRopeStoreOps
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
            assert lp0 - lp1 < GAP_TOL, f"prompt {i}: tokens differ at {first}, no tie"
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
