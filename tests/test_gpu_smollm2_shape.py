"""SmolLM2-135M's shape on the GPU (random weights: 30 layers, hidden 576, 9 query heads and 3
KV heads of 64, FFN 1536, tied embeddings) against HF transformers on the same GPU, both
bf16: prompt log-probs close, greedy tokens equal up to a near tie."""

from __future__ import annotations

import pytest
import torch
import transformers

from radixrt import Engine, SamplingParams
from radixrt.model.tiny import make_hf_checkpoint

pytestmark = pytest.mark.gpu

SHAPE = dict(
    num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
    head_dim=64, max_position_embeddings=2048,
)  # fmt: skip
PROMPTS = [[(7 * i + 13 * j) % 2000 + 10 for j in range(n)] for i, n in enumerate((5, 40, 130))]
NEW_TOKENS = 16
LOGPROB_ATOL = 0.1  # nats: bf16 through 30 layers, two implementations
GAP_TOL = 0.05  # nats: a different greedy token is a tie when HF's two log-probs are this close


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = str(tmp_path_factory.mktemp("smollm2-shape") / "model")
    return make_hf_checkpoint(path, "llama", tie_word_embeddings=True, **SHAPE)


def test_smollm2_shape_matches_hf_on_the_gpu(checkpoint):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    hf = hf.cuda().eval()
    engine = Engine(checkpoint, device="cuda", dtype="bfloat16", num_kv_blocks=256)
    try:
        params = SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=True
        )
        outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        engine.check_integrity()
    finally:
        engine.shutdown()
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out.token_ids], device="cuda")).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        ref_prompt = lp[: len(ids) - 1].gather(1, torch.tensor(ids[1:], device="cuda")[:, None])
        torch.testing.assert_close(
            torch.tensor(out.prompt_logprobs), ref_prompt[:, 0].cpu(), atol=LOGPROB_ATOL, rtol=0
        )
        for k, token in enumerate(out.token_ids):  # each of our greedy picks is HF's, or a tie
            row = lp[len(ids) - 1 + k]
            assert row.max() - row[token] < GAP_TOL, (ids[:3], k)
