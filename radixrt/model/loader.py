"""Read a local HF model dir: checks, safetensors weights, tokenizer.

Only safetensors checkpoints are supported: `model.safetensors`, or
`model.safetensors.index.json` plus the shards it names. Nothing is downloaded.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from radixrt.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
UNSUPPORTED_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf")


def check_model_dir(model_path: str, *, require_weights: bool = True) -> None:
    """Raise unless `model_path` is a local HF dir radixrt can serve.

    Checks: the dir exists, config.json parses into a supported `ModelConfig`, and (when
    `require_weights`; pass False for random "dummy" weights) safetensors weights are there,
    with every shard that an index names. Reads no tensor data.
    Raises FileNotFoundError (missing dir, config.json, weights or shard) or ValueError
    (unsupported architecture, malformed config.json or index).
    """
    _require_dir(model_path)
    try:
        ModelConfig.from_pretrained(model_path)
    except KeyError as e:
        raise ValueError(f"config.json in {model_path!r} lacks required key {e.args[0]!r}") from e
    if require_weights:
        _shard_plan(model_path)


def iterate_hf_weights(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Return an iterator of (HF parameter name, tensor) over every weight in a local HF dir.

    Tensors are on CPU in their stored dtype. With an index, each shard is opened once
    and exactly the names the index maps to it are yielded (shards in sorted order);
    otherwise every tensor of model.safetensors is. The dir, index and shard files are
    checked at call time: raises FileNotFoundError (missing dir, weights or shard) or
    ValueError (malformed index). During iteration, ValueError if a shard lacks a name
    that the index maps to it.
    """
    _require_dir(model_path)
    return _iterate_shards(_shard_plan(model_path))


def iterate_hf_weight_slices(model_path: str) -> Iterator[tuple[str, Any]]:
    """Like `iterate_hf_weights`, but yields safetensors slices (`safe_open(...).get_slice`)
    instead of tensors: indexing one (`s[a:b]`, `s[:, a:b]`) reads only that part of the
    file (tensor-parallel ranks read their shard). A slice is valid until the next item."""
    _require_dir(model_path)
    return _iterate_shards(_shard_plan(model_path), lazy=True)


def read_hf_tensors(model_path: str, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors whose HF name `wanted` accepts, read from a local HF dir (CPU, stored
    dtype); only those bytes are read. Same checks and errors as `iterate_hf_weights`."""
    _require_dir(model_path)
    out: dict[str, torch.Tensor] = {}
    for shard_path, names in _shard_plan(model_path):
        if names is not None and not any(wanted(n) for n in names):
            continue  # the index says this shard has none: do not open it
        with safe_open(shard_path, framework="pt", device="cpu") as f:
            for name in names if names is not None else f.keys():
                if wanted(name):
                    out[name] = f.get_tensor(name)
    return out


def _iterate_shards(
    plan: list[tuple[str, list[str] | None]], *, lazy: bool = False
) -> Iterator[tuple[str, Any]]:
    for shard_path, names in plan:
        with safe_open(shard_path, framework="pt", device="cpu") as f:
            if names is None:
                names = list(f.keys())
            else:
                missing = sorted(set(names) - set(f.keys()))
                if missing:
                    raise ValueError(
                        f"{INDEX_FILE} maps {len(missing)} tensors to {shard_path!r} that it "
                        f"lacks, e.g. {missing[:3]}"
                    )
            for name in names:
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


def load_tokenizer(model_path: str) -> PreTrainedTokenizerFast:
    """Load the fast (Rust `tokenizers`) tokenizer of a local HF dir; never downloads.

    Raises FileNotFoundError for a missing dir and ValueError when the dir has no
    tokenizer that transformers can load as a fast tokenizer.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _require_dir(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(
            f"the tokenizer in {model_path!r} loads as {type(tokenizer).__name__}, not a fast "
            "tokenizer; radixrt needs tokenizer.json (a `tokenizers` fast tokenizer)"
        )
    return tokenizer


def _require_dir(model_path: str) -> None:
    if not os.path.isdir(model_path):
        raise FileNotFoundError(
            f"model directory {model_path!r} does not exist (expected a local HF model dir "
            "with config.json and safetensors weights; nothing is downloaded)"
        )


def _shard_plan(model_path: str) -> list[tuple[str, list[str] | None]]:
    """[(safetensors path, names to read from it, None: all)], every file checked to exist."""
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
        f"with its shards ({hint}). PyTorch .bin/.pt checkpoints are not supported; "
        "convert them to safetensors first"
    )


def _plan_from_index(model_path: str, index_path: str) -> list[tuple[str, list[str] | None]]:
    with open(index_path) as f:
        index = json.load(f)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path!r} has no non-empty 'weight_map' object")
    names_by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        names_by_shard.setdefault(shard, []).append(name)
    plan: list[tuple[str, list[str] | None]] = []
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
