"""fp8 KV scales from a checkpoint (vLLM / llm-compressor naming), per layer.

Recognised names (with or without the leading `model.`), one scalar each:
`layers.{i}.self_attn.k_scale` / `.v_scale` (vLLM fp8 checkpoints), `layers.{i}.self_attn
.kv_scale` (older: one scale for K and V), and `layers.{i}.self_attn.{k,v}_proj.output_scale`
(compressed-tensors), `layers.{i}.self_attn.k_proj.k_scale` / `v_proj.v_scale` (ModelOpt).
A checkpoint has all of a layer's scales or none; a layer without any
gets 1.0. The model's weight loader skips these names (`is_kv_scale_name`).
"""

from __future__ import annotations

import re

from radixrt.kv.scales import KVScales

_PATTERNS = (
    re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(k|v|kv)_scale$"),
    re.compile(r"layers\.(\d+)\.self_attn\.(k|v)_proj\.output_scale$"),
    re.compile(r"layers\.(\d+)\.self_attn\.[kv]_proj\.(k|v)_scale$"),  # ModelOpt
)


def _parse(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") of a kv-scale tensor name, else None."""
    for pattern in _PATTERNS:
        m = pattern.search(name)
        if m:
            return int(m.group(1)), m.group(2)
    return None


def is_kv_scale_name(name: str) -> bool:
    return _parse(name) is not None


def load_kv_scales(model_path: str, num_layers: int) -> KVScales | None:
    """The checkpoint's per-tensor KV scales, or None when it has none. Raises ValueError for
    a scale that is not one positive number (per-head scales are not supported) or names a
    layer the model lacks."""
    from radixrt.model.loader import read_hf_tensors

    tensors = read_hf_tensors(model_path, is_kv_scale_name)
    if not tensors:
        return None
    k, v = [1.0] * num_layers, [1.0] * num_layers
    for name, t in sorted(tensors.items()):
        layer, which = _parse(name)  # type: ignore[misc]
        if t.numel() != 1:
            raise ValueError(
                f"checkpoint kv scale {name!r} has shape {tuple(t.shape)}: only per-tensor "
                "(one number) kv scales are supported"
            )
        if layer >= num_layers:
            raise ValueError(f"checkpoint kv scale {name!r} names layer {layer} of {num_layers}")
        value = float(t.float().item())
        if which in ("k", "kv"):
            k[layer] = value
        if which in ("v", "kv"):
            v[layer] = value
    return KVScales(tuple(k), tuple(v), model_path)
