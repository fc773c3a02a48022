"""Reading a PEFT LoRA adapter directory without torch: its config, the names and shapes of
its tensors (the safetensors header), and the checks that refuse what we do not serve.

A directory holds `adapter_config.json` and `adapter_model.safetensors`, with tensors named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`: A [r, in],
B [out, r]. The delta of a module is `scaling * B @ A`, scaling `lora_alpha / r` (or
`lora_alpha / sqrt(r)` with `use_rslora`). Every refusal is a `LoraLoadError` naming the
config field (or the tensor) at fault.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

from radixrt.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections a LoRA delta may adapt, and the merged layer each belongs to here
SERVED_MODULES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "o_proj": "o_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
}
_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_MAX_HEADER = 64 * 2**20  # a safetensors header larger than this is not an adapter's


class LoraLoadError(ValueError):
    """An adapter we refuse to load; `field` names the config field (or tensor) at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class AdapterInfo:
    """What the checks found in an adapter directory."""

    path: str  # the directory, absolute
    rank: int  # r
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rslora
    modules: tuple[str, ...]  # the adapted projections (names of SERVED_MODULES), sorted
    key: str  # digest of the config and the weights (equal files: equal key)
    base_model: str | None  # the config's base_model_name_or_path


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each served projection of `cfg`'s model (one rank)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def adapter_scaling(config: dict[str, Any]) -> float:
    """The delta's scale from a read adapter config (alpha / r, rslora: alpha / sqrt(r))."""
    r, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_config(path: str) -> dict[str, Any]:
    """adapter_config.json of `path`, checked for what we serve (LoraLoadError otherwise)."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoraLoadError(f"{path!r} has no {CONFIG_FILE} (not a PEFT adapter)", "lora_path")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoraLoadError(f"{file}: not readable JSON ({e})", "lora_path") from e
    if not isinstance(config, dict):
        raise LoraLoadError(f"{file}: not a JSON object", "lora_path")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraLoadError(f"peft_type={peft_type!r}: only LORA adapters are served", "peft_type")
    if config.get("use_dora"):
        raise LoraLoadError("use_dora=true: DoRA adapters are not served", "use_dora")
    if config.get("bias", "none") != "none":
        raise LoraLoadError(f"bias={config['bias']!r}: only bias='none' is served", "bias")
    if config.get("modules_to_save"):
        raise LoraLoadError(
            f"modules_to_save={config['modules_to_save']!r}: adapters that replace whole "
            "modules are not served",
            "modules_to_save",
        )
    if config.get("fan_in_fan_out"):
        raise LoraLoadError("fan_in_fan_out=true is not served", "fan_in_fan_out")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise LoraLoadError(f"{field}: per-module ranks or alphas are not served", field)
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraLoadError(f"r={r!r}: must be an integer >= 1", "r")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraLoadError(f"lora_alpha={alpha!r}: must be a number", "lora_alpha")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unserved = sorted(set(targets) - set(SERVED_MODULES))
        if unserved:
            raise LoraLoadError(
                f"target_modules: {', '.join(unserved)} not served (served: "
                f"{', '.join(SERVED_MODULES)})",
                "target_modules",
            )
    return config


def read_header(file: str) -> dict[str, Any]:
    """The tensor table of a safetensors file ({name: {dtype, shape, data_offsets}})."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise LoraLoadError(f"{file}: not a safetensors file", "lora_path")
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_HEADER:
            raise LoraLoadError(f"{file}: not a safetensors file", "lora_path")
        try:
            table = json.loads(f.read(size))
        except ValueError as e:
            raise LoraLoadError(f"{file}: not a safetensors file ({e})", "lora_path") from e
    table.pop("__metadata__", None)
    return table


def parse_tensor_name(name: str) -> tuple[int, str, str] | None:
    """(layer, module, "A" | "B") of a PEFT LoRA tensor name, None for any other name."""
    m = _TENSOR.match(name)
    return None if m is None else (int(m.group(1)), m.group(2), m.group(3))


def digest(path: str) -> str:
    """The adapter's key: SHA-256 of its config and weights files (hex, 32 characters)."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:32]


def read_adapter(path: str, model: ModelConfig, max_rank: int) -> AdapterInfo:
    """Read and check the adapter at `path` for `model` with ranks up to `max_rank`. Raises
    LoraLoadError naming the field: DoRA, unserved modules or options, a rank above
    `max_rank`, tensors that do not fit the base model (a base-model mismatch)."""
    path = os.path.abspath(path)
    config = read_config(path)
    r = config["r"]
    if r > max_rank:
        raise LoraLoadError(f"r={r} is above max_lora_rank={max_rank}", "r")
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoraLoadError(f"{path!r} has no {WEIGHTS_FILE}", "lora_path")
    base = config.get("base_model_name_or_path")
    shapes = module_shapes(model)
    found: dict[tuple[int, str], set[str]] = {}
    for name, entry in read_header(file).items():
        parsed = parse_tensor_name(name)
        if parsed is None:
            raise LoraLoadError(
                f"tensor {name!r} adapts no served module (served: {', '.join(SERVED_MODULES)})",
                "target_modules",
            )
        layer, module, kind = parsed
        if module not in SERVED_MODULES:
            raise LoraLoadError(
                f"target_modules: {module} is not served (served: {', '.join(SERVED_MODULES)})",
                "target_modules",
            )
        fan_in, fan_out = shapes[module]
        want = [r, fan_in] if kind == "A" else [fan_out, r]
        if layer >= model.num_layers or list(entry.get("shape", ())) != want:
            raise LoraLoadError(
                f"base_model_name_or_path={base!r} does not match the served model: {name} has "
                f"shape {entry.get('shape')}, the model needs {want} in {model.num_layers} layers",
                "base_model_name_or_path",
            )
        found.setdefault((layer, module), set()).add(kind)
    halves = [f"layer {k[0]} {k[1]}" for k, v in found.items() if v != {"A", "B"}]
    if halves or not found:
        what = f"{halves[0]} lacks lora_A or lora_B" if halves else "no LoRA tensors"
        raise LoraLoadError(f"{file}: {what}", "lora_path")
    modules = tuple(sorted({m for _, m in found}))
    return AdapterInfo(path, r, adapter_scaling(config), modules, digest(path), base)
