"""The front process's model-dir check and tokenizer, without torch or the model stack.

`transformers` imports torch as soon as it is installed (`is_torch_available()` at import
time), which costs the front seconds and hundreds of MB it never uses. The front loads
the tokenizer with torch hidden from transformers: while transformers is first imported
and the tokenizer built, `sys.modules["torch"]` is None, so transformers sees no torch
and takes its tokenizers-only path; the entry is removed again afterwards. Tokenizers do
not use torch (only `return_tensors="pt"` would, which the front never asks for).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from radixrt.config import ModelConfig

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def check_model_dir(model_path: str, *, require_weights: bool = True) -> ModelConfig:
    """The dir's ModelConfig; raises FileNotFoundError (no dir, config.json or weights)
    or ValueError (unsupported or malformed config.json). The scheduler process checks
    the weights in full (every shard) when it loads them."""
    if not os.path.isdir(model_path):
        raise FileNotFoundError(
            f"model directory {model_path!r} does not exist (expected a local HF model dir "
            "with config.json and safetensors weights; nothing is downloaded)"
        )
    try:
        config = ModelConfig.from_pretrained(model_path)
    except KeyError as e:
        raise ValueError(f"config.json in {model_path!r} lacks required key {e.args[0]!r}") from e
    if require_weights and not any(
        os.path.isfile(os.path.join(model_path, f)) for f in WEIGHT_FILES
    ):
        raise FileNotFoundError(
            f"no safetensors weights in {model_path!r} (expected {' or '.join(WEIGHT_FILES)})"
        )
    return config


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """transformers imported inside sees no torch (unless it is imported already)."""
    hide = "torch" not in sys.modules and "transformers" not in sys.modules
    quiet = "TRANSFORMERS_NO_ADVISORY_WARNINGS" not in os.environ
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # import torch -> ImportError
    if quiet:  # "PyTorch was not found. Models won't be available ..."
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        yield
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
        if quiet:
            os.environ.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)


def load_tokenizer(model_path: str) -> Any:
    """The fast (Rust `tokenizers`) tokenizer of a local HF dir, never downloading and
    without importing torch. Raises FileNotFoundError for a missing dir and ValueError
    when the dir has no tokenizer that transformers loads as a fast tokenizer."""
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model directory {model_path!r} does not exist")
    with _torch_hidden():
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(
            f"the tokenizer in {model_path!r} loads as {type(tokenizer).__name__}, not a fast "
            "tokenizer; radixrt needs tokenizer.json (a `tokenizers` fast tokenizer)"
        )
    return tokenizer
