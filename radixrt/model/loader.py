"""The weights of a local model dir as torch tensors: safetensors, or a GGUF file dequantized
at load (`radixrt.model.gguf_loader`). The dir's checks, its file plan and its tokenizer are
`radixrt.hf_dir`, which needs no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import safe_open

from radixrt.hf_dir import INDEX_FILE, ShardPlan, gguf_weights, require_dir, shard_plan


def iterate_hf_weights(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Return an iterator of (HF parameter name, tensor) over every weight in a local HF dir.

    Tensors are on CPU in their stored dtype. With an index, each shard is opened once
    and exactly the names the index maps to it are yielded (shards in sorted order);
    otherwise every tensor of model.safetensors is. The dir, index and shard files are
    checked at call time: raises FileNotFoundError (missing dir, weights or shard) or
    ValueError (malformed index). During iteration, ValueError if a shard lacks a name
    that the index maps to it. A dir whose weights are a GGUF file yields its tensors
    dequantized to float32.
    """
    require_dir(model_path)
    if gguf_weights(model_path) is not None:
        from radixrt.model.gguf_loader import iterate_gguf_weights

        return iterate_gguf_weights(model_path)
    return _iterate_shards(shard_plan(model_path))


def iterate_hf_weight_slices(model_path: str) -> Iterator[tuple[str, Any]]:
    """Like `iterate_hf_weights`, but yields safetensors slices (`safe_open(...).get_slice`)
    instead of tensors: indexing one (`s[a:b]`, `s[:, a:b]`) reads only that part of the
    file (tensor-parallel ranks read their shard). A slice is valid until the next item.
    GGUF weights come as whole tensors (dequantized: there is nothing to slice lazily)."""
    require_dir(model_path)
    if gguf_weights(model_path) is not None:
        return iterate_hf_weights(model_path)
    return _iterate_shards(shard_plan(model_path), lazy=True)


def read_hf_tensors(model_path: str, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors whose HF name `wanted` accepts, read from a local HF dir (CPU, stored
    dtype); only those bytes are read. Same checks and errors as `iterate_hf_weights`.
    A GGUF model has no tensors that radixrt reads this way (kv scales): {}."""
    require_dir(model_path)
    if gguf_weights(model_path) is not None:
        return {}
    out: dict[str, torch.Tensor] = {}
    for shard_path, names in shard_plan(model_path):
        if names is not None and not any(wanted(n) for n in names):
            continue  # the index says this shard has none: do not open it
        with safe_open(shard_path, framework="pt", device="cpu") as f:
            for name in names if names is not None else f.keys():
                if wanted(name):
                    out[name] = f.get_tensor(name)
    return out


def _iterate_shards(plan: ShardPlan, *, lazy: bool = False) -> Iterator[tuple[str, Any]]:
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
