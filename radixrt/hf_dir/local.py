"""A local model directory, read without torch: its checks, its config, its tokenizer and
the files that hold its weights. The model loader (tensors, with torch), the front (tokenizer
only) and the DSL's HTTP backend all read a directory through this module.

Weights are safetensors (`model.safetensors`, or `model.safetensors.index.json` plus the
shards it names) or one GGUF file beside config.json (the dir that `radixrt.hf_dir.gguf_file`
prepares for a GGUF model). Nothing is downloaded here (`radixrt.hf_dir.resolve` does that).

`transformers` imports torch as soon as it is installed (`is_torch_available()` at import
time), which costs a torch-free process seconds and hundreds of MB it never uses. So the
tokenizer is built with torch hidden from transformers when torch is not imported yet: while
transformers is first imported, `sys.modules["torch"]` is None, transformers sees no torch and
takes its tokenizers-only path; the entry is removed again afterwards. Tokenizers do not use
torch (only `return_tensors="pt"` would, which radixrt never asks for).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from radixrt.config import ModelConfig
from radixrt.hf_dir.gguf_file import LINK_NAME, TENSOR_INDEX

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
UNSUPPORTED_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")

# [(safetensors path, the tensor names to read from it; None: all of them)]
ShardPlan = list[tuple[str, list[str] | None]]


def check_model_dir(model_path: str, *, require_weights: bool = True) -> ModelConfig:
    """The ModelConfig of `model_path`, after checking that it is a local HF dir radixrt can
    serve: the dir exists, config.json parses into a supported `ModelConfig`, and (when
    `require_weights`; pass False for random "dummy" weights) safetensors weights are there,
    with every shard that an index names. Reads no tensor data.
    Raises FileNotFoundError (missing dir, config.json, weights or shard) or ValueError
    (unsupported architecture, malformed config.json or index)."""
    require_dir(model_path)
    try:
        config = ModelConfig.from_pretrained(model_path)
    except KeyError as e:
        raise ValueError(f"config.json in {model_path!r} lacks required key {e.args[0]!r}") from e
    if require_weights and gguf_weights(model_path) is None:
        shard_plan(model_path)
    return config


def require_dir(model_path: str) -> None:
    """Raise FileNotFoundError unless `model_path` is a directory."""
    if not os.path.isdir(model_path):
        raise FileNotFoundError(
            f"model directory {model_path!r} does not exist (expected a local HF model dir "
            "with config.json and safetensors weights, a .gguf file or a hub id org/name)"
        )


def load_tokenizer(model_path: str) -> Any:
    """The fast (Rust `tokenizers`) tokenizer of a local HF dir (a transformers
    `PreTrainedTokenizerFast`), never downloading and without importing torch. Raises
    FileNotFoundError for a missing dir and ValueError when the dir has no tokenizer that
    transformers loads as a fast tokenizer."""
    require_dir(model_path)
    with _torch_hidden():
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(
            f"the tokenizer in {model_path!r} loads as {type(tokenizer).__name__}, not a fast "
            "tokenizer; radixrt needs tokenizer.json (a `tokenizers` fast tokenizer)"
        )
    return tokenizer


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """transformers imported inside sees no torch (unless either is imported already)."""
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


def gguf_weights(model_path: str) -> str | None:
    """The GGUF file that holds the weights of the model dir `model_path` (a dir prepared by
    `radixrt.hf_dir.gguf_file`: config.json and its tensor table beside the link to the
    file), or None: the weights are safetensors."""
    if not os.path.isfile(os.path.join(model_path, TENSOR_INDEX)):
        return None
    return os.path.join(model_path, LINK_NAME)


def shard_plan(model_path: str) -> ShardPlan:
    """The safetensors files of a model dir and what to read from each, every file checked
    to exist. Raises FileNotFoundError (no weights, a missing shard) or ValueError (a
    malformed index)."""
    index_path = os.path.join(model_path, INDEX_FILE)
    if os.path.isfile(index_path):
        return _plan_from_index(model_path, index_path)
    single = os.path.join(model_path, SINGLE_FILE)
    if os.path.isfile(single):
        return [(single, None)]
    found = sorted(
        os.path.basename(p)
        for pattern in (*UNSUPPORTED_WEIGHT_PATTERNS, "*.safetensors")
        for p in glob.glob(os.path.join(model_path, pattern))
    )
    hint = f"found {found[:5]}" if found else "found no weight files"
    raise FileNotFoundError(
        f"no safetensors weights in {model_path!r}: expected {SINGLE_FILE} or {INDEX_FILE} "
        f"with its shards, or one .gguf file ({hint}). PyTorch .bin/.pt checkpoints are not "
        "supported; convert them to safetensors first"
    )


def _plan_from_index(model_path: str, index_path: str) -> ShardPlan:
    with open(index_path) as f:
        index = json.load(f)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path!r} has no non-empty 'weight_map' object")
    names_by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        names_by_shard.setdefault(shard, []).append(name)
    plan: ShardPlan = []
    for shard in sorted(names_by_shard):
        shard_path = os.path.join(model_path, shard)
        if not os.path.isfile(shard_path):
            raise FileNotFoundError(
                f"{INDEX_FILE} in {model_path!r} names shard {shard!r}, which is missing "
                f"(it should hold {len(names_by_shard[shard])} tensors, "
                f"e.g. {names_by_shard[shard][0]!r})"
            )
        plan.append((shard_path, names_by_shard[shard]))
    return plan
