"""Model files, read without torch: local HF dirs (`local`), GGUF files (`gguf_file`), hub ids
(`hub`), the SmolLM2 file (`smollm2`), and what `--model` may name (`resolve`)."""

from radixrt.hf_dir.local import (
    INDEX_FILE,
    SINGLE_FILE,
    ShardPlan,
    check_model_dir,
    gguf_weights,
    load_tokenizer,
    require_dir,
    shard_plan,
)
from radixrt.hf_dir.resolve import resolve_model

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "ShardPlan",
    "check_model_dir",
    "gguf_weights",
    "load_tokenizer",
    "require_dir",
    "resolve_model",
    "shard_plan",
]
