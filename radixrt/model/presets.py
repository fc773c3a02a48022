"""Model shapes of public checkpoints, for benchmarks with random ("dummy") weights.

`write_dummy_model_dir` writes an HF-style dir (config.json + the tiny model's tokenizer) so
that `Engine(dir, load_format="dummy")` builds the real shape with random weights, without
downloading anything. The tokenizer is the tiny one (2k tokens, all ids valid in the larger
vocabularies), so bos/eos in config.json are the tiny tokenizer's ids.
"""

from __future__ import annotations

import json
import os
from typing import Any

# preset name -> HF config.json (architecture and shape as published)
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
    },
}
# Llama-3.2-1B's shape (tied embeddings, head_dim 64; its llama3 RoPE scaling left out: random
# weights): small enough that several replicas share one GPU (bench_router)
PRESETS["llama-3.2-1b"] = {
    **PRESETS["llama-3-8b"],
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "tie_word_embeddings": True,
}
# Llama-3-8B's shape with a 32k context (as Llama 3.1 allows; plain RoPE, fine for random
# weights): the long-history benchmark (4-16k-token histories) needs more than 8192.
PRESETS["llama-3-8b-32k"] = {**PRESETS["llama-3-8b"], "max_position_embeddings": 32768}


def write_dummy_model_dir(out_dir: str, preset: str = "llama-3-8b") -> str:
    """Write config.json of `preset` and the tiny tokenizer into `out_dir` (created if
    missing; existing files are overwritten). Returns `out_dir`. Raises ValueError for an
    unknown preset. Writes the tiny tokenizer (no model is built or trained)."""
    from radixrt.model.tiny import BOS_ID, EOS_IDS
    from radixrt.model.tiny_tokenizer import write_tiny_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    os.makedirs(out_dir, exist_ok=True)
    write_tiny_tokenizer(out_dir)
    config = dict(PRESETS[preset], bos_token_id=BOS_ID, eos_token_id=list(EOS_IDS))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return out_dir
