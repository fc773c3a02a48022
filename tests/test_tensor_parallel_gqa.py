"""Tensor parallelism (CPU, gloo, 2 ranks) on a Qwen2 checkpoint with ONE KV head (replicated
on both ranks), q/k/v biases, tied embeddings and an odd vocabulary; then a worker killed.

Its own module: one tensor-parallel engine per process, and test_tensor_parallel.py's engine
lives until its module ends."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from radixrt import Engine, SamplingParams
from radixrt.executor.tp.workers import TensorParallelError
from radixrt.model.tiny import make_hf_checkpoint

B = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13] * 9, list(range(20, 75)), [7, 100, 900, 999]]


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory):
    """Qwen2 (q/k/v biases), tied embeddings, ONE KV head (replicated on both ranks), an odd
    vocabulary (padded to a multiple of 2)."""
    path = str(tmp_path_factory.mktemp("tp") / "qwen2-kv1")
    return make_hf_checkpoint(
        path, "qwen2", num_heads=4, num_kv_heads=1, tie_word_embeddings=True, vocab_size=1001
    )


def test_replicated_kv_heads_then_dead_worker(gqa_model_dir):
    """num_kv_heads < tp: the same greedy tokens as one rank. Then SIGKILL the worker: the
    watchdog notices without a step (check_health), steps raise TensorParallelError, and
    nothing is left running."""
    opts = dict(device="cpu", dtype="float32", block_size=B, overlap_schedule=True)
    want = Engine(gqa_model_dir, **opts).generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    engine = Engine(gqa_model_dir, tensor_parallel_size=2, **opts)
    try:
        got = engine.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
            )
        (worker,) = engine.core.runner.workers.procs
        start = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL)
        while True:
            try:
                engine.core.check_health()
            except TensorParallelError as e:
                assert f"rank 1 (pid {worker.pid}) was killed by SIGKILL" in str(e)
                break
            assert time.monotonic() - start < 10, "the watchdog did not notice"
            time.sleep(0.05)
        with pytest.raises(TensorParallelError, match="killed by SIGKILL"):
            engine.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY)
        assert worker.poll() is not None  # reaped: no zombie, no orphan
    finally:
        engine.core.shutdown()
