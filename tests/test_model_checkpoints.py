"""Our model on checkpoints written by transformers' save_pretrained (sharded) matches
HF: per-token log-probs of a prompt and greedy continuations."""

from __future__ import annotations

import pytest
import torch
import transformers

from radixrt import Engine, SamplingParams
from radixrt.model.tiny import make_hf_checkpoint

IDS = [17, 250, 999, 12, 1500, 77, 31, 640, 8, 1999, 333, 42, 1024, 5, 700, 91, 23]

CASES = {
    "llama-sharded": dict(arch="llama", max_shard_size="100KB"),
    "qwen3-sharded": dict(arch="qwen3", max_shard_size="100KB"),
    "qwen2-bias": dict(arch="qwen2"),
    "mistral": dict(arch="mistral"),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama3-rope": dict(
        arch="llama",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "linear-rope": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_hf(tmp_path, case):
    path = make_hf_checkpoint(str(tmp_path / case), **CASES[case])
    if CASES[case].get("max_shard_size"):
        assert (tmp_path / case / "model.safetensors.index.json").exists()
    _assert_matches_hf(path)


def _assert_matches_hf(path: str, **engine_kw) -> None:
    """Prompt log-probs and 12 greedy tokens of IDS: our engine's equal HF's."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([IDS])).logits[0]
        ref_lp = torch.log_softmax(logits.float(), -1)[:-1].gather(
            1, torch.tensor(IDS[1:]).unsqueeze(1)
        )[:, 0]
        x = torch.tensor([IDS])
        hf.generation_config.eos_token_id = None  # as ignore_eos (min_new_tokens masks EOS out)
        ref_tokens = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )[0, len(IDS) :].tolist()
    engine = Engine(path, device="cpu", dtype="float32", block_size=4, **engine_kw)
    out = engine.generate(
        prompt_token_ids=[IDS],
        sampling_params=SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=True
        ),
    )[0]
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), ref_lp, atol=1e-4, rtol=1e-4)
    assert out.token_ids == ref_tokens
    engine.check_integrity()


def _edit_config(path: str, **fields) -> None:
    import json
    import os

    config = os.path.join(path, "config.json")
    with open(config) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(config, "w") as f:
        json.dump(cfg, f)


def test_sliding_window_in_force_limits_the_context(tmp_path):
    """Mistral with sliding_window=32 < max_position_embeddings (512): the default context is
    clamped to the window, where every layer attends all keys as HF's does (equal tokens); a
    larger explicit max_model_len is refused naming the field."""
    path = make_hf_checkpoint(str(tmp_path / "m"), arch="mistral")
    _edit_config(path, sliding_window=32)
    _assert_matches_hf(path)  # 17 prompt + 12 new tokens: inside the window
    engine = Engine(path, device="cpu", load_format="dummy")
    assert engine.max_model_len == 32
    with pytest.raises(ValueError, match="sliding_window=32"):
        Engine(path, device="cpu", load_format="dummy", max_model_len=64)
    assert Engine(path, device="cpu", load_format="dummy", max_model_len=24).max_model_len == 24


def test_sliding_window_not_in_force_is_served_whole(tmp_path):
    """Qwen2's use_sliding_window=false, and a Mistral window >= max_position_embeddings:
    the whole context is served."""
    qwen = make_hf_checkpoint(str(tmp_path / "q"), arch="qwen2")
    _edit_config(qwen, sliding_window=32, use_sliding_window=False, max_window_layers=0)
    assert Engine(qwen, device="cpu", load_format="dummy").max_model_len == 512
    mistral = make_hf_checkpoint(str(tmp_path / "m"), arch="mistral")
    _edit_config(mistral, sliding_window=4096)
    assert Engine(mistral, device="cpu", load_format="dummy").max_model_len == 512


def test_missing_tensor_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_hf_checkpoint(str(tmp_path / "m"), arch="llama")
    weights = load_file(f"{path}/model.safetensors")
    weights.pop("model.layers.0.mlp.up_proj.weight")
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks"):
        Engine(path, device="cpu")


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import json

    path = make_hf_checkpoint(str(tmp_path / "m"), arch="llama")
    config = tmp_path / "m" / "config.json"
    cfg = json.loads(config.read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    config.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        Engine(path, device="cpu")


def test_dummy_weights_need_no_safetensors(tmp_path):
    import os

    path = make_hf_checkpoint(str(tmp_path / "m"), arch="llama")
    os.remove(f"{path}/model.safetensors")
    engine = Engine(path, device="cpu", load_format="dummy")
    out = engine.generate(prompt_token_ids=[IDS], sampling_params=SamplingParams(max_tokens=4))
    assert len(out[0].token_ids) <= 4
    engine.check_integrity()
