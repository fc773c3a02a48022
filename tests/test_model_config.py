"""config.json fields the model code does not implement are refused at load, naming the field;
windows not in force are accepted (synthetic configs, no weights)."""

from __future__ import annotations

import pytest

from radixrt.config import ModelConfig
from radixrt.limits import resolve_max_model_len

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def _cfg(**fields) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE, **fields})


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            "rope_scaling type 'longrope'",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "attention_bias=true"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ],
)
def test_unimplemented_fields_are_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        _cfg(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_scaling": {"rope_type": "default"}},
        {"hidden_act": "silu", "mlp_bias": False, "attention_bias": False},
        {"architectures": ["Qwen2ForCausalLM"]},  # q/k/v biases: implemented
        {"partial_rotary_factor": 1.0, "final_logit_softcapping": None},
    ],
)
def test_implemented_fields_load(fields):
    _cfg(**fields)


@pytest.mark.parametrize(
    ("fields", "window"),
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, 4096),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, None),
        (  # Qwen2.5's: a window named but switched off
            {
                "architectures": ["Qwen2ForCausalLM"],
                "sliding_window": 131072,
                "use_sliding_window": False,
                "max_window_layers": 28,
            },
            None,
        ),
        (  # switched on, but only from layer 28 of 2
            {
                "architectures": ["Qwen2ForCausalLM"],
                "sliding_window": 64,
                "use_sliding_window": True,
                "max_window_layers": 28,
            },
            None,
        ),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "sliding_window": 64,
                "use_sliding_window": True,
                "max_window_layers": 1,
            },
            64,
        ),
        (
            {
                "architectures": ["Qwen3ForCausalLM"],
                "sliding_window": 64,
                "layer_types": ["full_attention", "full_attention"],
            },
            None,
        ),
        (
            {
                "architectures": ["Qwen3ForCausalLM"],
                "sliding_window": 64,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            64,
        ),
    ],
)
def test_sliding_window_in_force(fields, window):
    assert _cfg(**fields).sliding_window == window


def test_served_length_and_the_window():
    assert resolve_max_model_len(None, 512, None) == 512
    assert resolve_max_model_len(100, 512, None) == 100
    assert resolve_max_model_len(None, 512, 4096) == 512  # the window is never reached
    assert resolve_max_model_len(None, 32768, 4096) == 4096  # clamped
    assert resolve_max_model_len(2048, 32768, 4096) == 2048
    with pytest.raises(ValueError, match="sliding_window=4096"):
        resolve_max_model_len(8192, 32768, 4096)
