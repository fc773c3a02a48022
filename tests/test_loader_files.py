"""radixrt.model.loader on checkpoints written by transformers' save_pretrained."""

from __future__ import annotations

import json
import os

import pytest
import torch

from radixrt import hf_dir
from radixrt.config import ModelConfig
from radixrt.hf_dir import check_model_dir, load_tokenizer
from radixrt.model import loader
from radixrt.model.loader import iterate_hf_weights
from radixrt.model.tiny import make_hf_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0}


def _hf_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_sharded_checkpoint_yields_every_parameter(tmp_path, arch: str) -> None:
    model_dir = make_hf_checkpoint(str(tmp_path / arch), arch, max_shard_size="200KB")
    with open(os.path.join(model_dir, hf_dir.INDEX_FILE)) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 1
    assert not os.path.exists(os.path.join(model_dir, hf_dir.SINGLE_FILE))
    check_model_dir(model_dir)

    state = _hf_state_dict(model_dir)
    names = []
    for name, tensor in iterate_hf_weights(model_dir):
        names.append(name)
        assert tensor.device.type == "cpu" and tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(state)


def test_each_shard_opened_once(tmp_path, monkeypatch) -> None:
    model_dir = make_hf_checkpoint(str(tmp_path / "m"), "llama", max_shard_size="200KB")
    opened: list[str] = []
    real_safe_open = loader.safe_open

    def counting_safe_open(path: str, *args, **kwargs):
        opened.append(os.path.basename(path))
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", counting_safe_open)
    list(iterate_hf_weights(model_dir))
    with open(os.path.join(model_dir, hf_dir.INDEX_FILE)) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert sorted(opened) == sorted(shards)


@pytest.mark.parametrize(
    ("arch", "qk_norm", "attention_bias", "head_dim"),
    [("llama", False, False, 16), ("qwen2", False, True, 16), ("qwen3", True, False, 32)],
)
def test_config_flags(tmp_path, arch, qk_norm, attention_bias, head_dim) -> None:
    model_dir = make_hf_checkpoint(str(tmp_path / arch), arch)
    cfg = ModelConfig.from_pretrained(model_dir)
    assert (cfg.qk_norm, cfg.attention_bias, cfg.head_dim) == (qk_norm, attention_bias, head_dim)
    names = {name for name, _ in iterate_hf_weights(model_dir)}
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == qk_norm
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == attention_bias
    weights = dict(iterate_hf_weights(model_dir))
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (4 * head_dim, 64)


def test_tied_embeddings(tmp_path) -> None:
    model_dir = make_hf_checkpoint(str(tmp_path / "tied"), "qwen3", tie_word_embeddings=True)
    assert ModelConfig.from_pretrained(model_dir).tie_word_embeddings
    names = {name for name, _ in iterate_hf_weights(model_dir)}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    state = _hf_state_dict(model_dir)
    torch.testing.assert_close(state["lm_head.weight"], state["model.embed_tokens.weight"])


@pytest.mark.parametrize("rope_scaling", [LLAMA3_ROPE, LINEAR_ROPE])
def test_rope_scaling_written_in_hub_layout(tmp_path, rope_scaling) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = make_hf_checkpoint(
        str(tmp_path / "rope"), "llama", rope_scaling=rope_scaling, rope_theta=500000.0
    )
    cfg = ModelConfig.from_pretrained(model_dir)
    assert cfg.rope_scaling == rope_scaling and cfg.rope_theta == 500000.0
    hf_cfg = AutoConfig.from_pretrained(model_dir)
    hf_rope = getattr(hf_cfg, "rope_parameters", None) or hf_cfg.rope_scaling  # v5 or v4 name
    assert hf_rope["rope_type"] == rope_scaling["rope_type"]
    assert hf_rope.get("rope_theta", getattr(hf_cfg, "rope_theta", None)) == 500000.0
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()


def test_load_tokenizer(tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    model_dir = make_hf_checkpoint(str(tmp_path / "m"), "mistral")
    tokenizer = load_tokenizer(model_dir)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert len(tokenizer) == ModelConfig.from_pretrained(model_dir).vocab_size
    assert tokenizer.decode(tokenizer.encode("héllo 世界 🙂")) == "héllo 世界 🙂"


def test_make_hf_checkpoint_rejects_bad_input(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        make_hf_checkpoint(str(tmp_path / "a"), "gpt2")
    with pytest.raises(ValueError, match="unknown shape keys \\['layers'\\]"):
        make_hf_checkpoint(str(tmp_path / "b"), "llama", layers=2)


# --- errors -------------------------------------------------------------------------------


def _write_config(model_dir, **overrides) -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **overrides,
    }
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg))


def test_missing_dir(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    for fn in (check_model_dir, iterate_hf_weights, load_tokenizer):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            fn(missing)


def test_dir_without_config(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_model_dir(str(tmp_path))


def test_unsupported_architecture(tmp_path) -> None:
    _write_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        check_model_dir(str(tmp_path))


def test_config_missing_key(tmp_path) -> None:
    _write_config(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lacks required key 'hidden_size'"):
        check_model_dir(str(tmp_path))


def test_bin_only_dir(tmp_path) -> None:
    _write_config(tmp_path)
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    for fn in (check_model_dir, iterate_hf_weights):
        with pytest.raises(FileNotFoundError, match="pytorch_model.bin") as info:
            fn(str(tmp_path))
        assert ".bin/.pt checkpoints are not supported" in str(info.value)
        assert "model.safetensors" in str(info.value)
    check_model_dir(str(tmp_path), require_weights=False)  # enough for dummy weights


def test_empty_dir_weights(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="found no weight files"):
        iterate_hf_weights(str(tmp_path))


def test_index_naming_missing_shard(tmp_path) -> None:
    model_dir = make_hf_checkpoint(str(tmp_path / "m"), "llama", max_shard_size="200KB")
    with open(os.path.join(model_dir, hf_dir.INDEX_FILE)) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(model_dir, shard))
    for fn in (check_model_dir, iterate_hf_weights):
        with pytest.raises(FileNotFoundError, match=f"names shard '{shard}', which is missing"):
            fn(model_dir)


def test_malformed_index(tmp_path) -> None:
    _write_config(tmp_path)
    (tmp_path / hf_dir.INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="no non-empty 'weight_map'"):
        iterate_hf_weights(str(tmp_path))


def test_index_promises_tensor_shard_lacks(tmp_path) -> None:
    model_dir = make_hf_checkpoint(str(tmp_path / "m"), "llama", max_shard_size="200KB")
    index_path = os.path.join(model_dir, hf_dir.INDEX_FILE)
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = sorted(
        set(index["weight_map"].values())
    )[0]
    with open(index_path, "w") as f:
        json.dump(index, f)
    weights = iterate_hf_weights(model_dir)
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        list(weights)
