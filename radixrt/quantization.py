"""FP8 (W8A8) weight quantization: which scheme a model runs, from its checkpoint's
`quantization_config` or from the `quantization` option (plain data, no torch).

A scheme fixes two granularities: weight scales per output channel or per tensor, and
activation scales per token (always dynamic) or per tensor (a checkpoint's static
`input_scale`, or dynamic). Checkpoint layouts read (tensor names beside each `*.weight`
stored as float8_e4m3fn):
- compressed-tensors `float-quantized` (llm-compressor's FP8_DYNAMIC / FP8 schemes):
  `weight_scale` [N, 1] (channel) or [1] (tensor), `input_scale` [1] for static activations;
- ModelOpt `FP8` (per-tensor `weight_scale` and static `input_scale`, fp32 scalars) and
  `FP8_PER_CHANNEL_PER_TOKEN` (`weight_scale` [N]); the config is `quantization_config`
  with quant_method "modelopt" or the legacy `hf_quant_config.json`;
- quant_method "fp8" without `weight_block_size` (AutoFP8 / vLLM's serialized fp8):
  per-tensor `weight_scale`, `input_scale` when `activation_scheme` is "static".
Anything else (int8, AWQ, GPTQ, block-wise or group-wise fp8, fp4, weight-only fp8, ...) is
refused with a ValueError naming it. lm_head and embeddings stay in the model dtype unless a
checkpoint quantizes lm_head.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

QUANTIZATIONS = ("fp8",)  # the `quantization` option (None: the checkpoint's, if any)
FP8_ACTIVATION_SCALES = ("auto", "token", "tensor")  # auto: the checkpoint's, else token
WEIGHT_SCALES = ("channel", "tensor")
SUPPORTED = (
    "compressed-tensors float-quantized fp8 (weights channel/tensor, activations dynamic "
    "token, static or dynamic tensor), modelopt FP8 / FP8_PER_CHANNEL_PER_TOKEN, fp8 "
    "without weight_block_size"
)


@dataclass(frozen=True)
class Fp8Scheme:
    """How the decoder's linear layers run in FP8."""

    weight_scale: str  # "channel": [N] per output row; "tensor": one per weight
    activation_scale: str  # "token": dynamic per row; "tensor": one per GEMM input
    static_input_scale: bool = False  # tensor activations: the checkpoint's input_scale
    # the checkpoint layout ("compressed-tensors", "modelopt", "fp8"); None: weights are
    # quantized at load from a 16/32-bit checkpoint (or dummy weights)
    checkpoint_format: str | None = None
    # which HF linear modules (e.g. "model.layers.0.mlp.down_proj", "lm_head") the
    # checkpoint quantized: compressed-tensors targets / ignore, ModelOpt exclude_modules
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        if self.weight_scale not in WEIGHT_SCALES:
            raise ValueError(f"weight_scale must be one of {WEIGHT_SCALES}")
        if self.activation_scale not in ("token", "tensor"):
            raise ValueError("activation_scale must be 'token' or 'tensor'")
        if self.static_input_scale and self.activation_scale != "tensor":
            raise ValueError("a static input scale is per tensor")

    @property
    def from_checkpoint(self) -> bool:
        return self.checkpoint_format is not None

    def quantizes(self, hf_module: str) -> bool:
        """Whether the linear module `hf_module` (HF name, e.g. "lm_head",
        "model.layers.3.self_attn.q_proj") is FP8 under this scheme."""
        return any(_matches(t, hf_module) for t in self.targets) and not any(
            _matches(i, hf_module) for i in self.ignore
        )

    def describe(self) -> str:
        act = "static" if self.static_input_scale else "dynamic"
        source = self.checkpoint_format or "quantized at load"
        return (
            f"fp8 W8A8: {self.weight_scale} weight scales, {act} {self.activation_scale} "
            f"activation scales ({source})"
        )


def _matches(pattern: str, name: str) -> bool:
    """compressed-tensors' target grammar (class name "Linear", "re:<regex>", exact name)
    and ModelOpt's fnmatch wildcards (`*`); names with or without the leading "model."."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    short = name.removeprefix("model.")
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(short, pattern)
    return pattern in (name, short) or name.endswith("." + pattern)


def checkpoint_scheme(quant: dict[str, Any] | None) -> Fp8Scheme | None:
    """The FP8 scheme of a checkpoint's `quantization_config` (None: not quantized).
    Raises ValueError naming what is not supported."""
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config must be an object, got {quant!r}")
    method = str(quant.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method.startswith("modelopt"):
        return _modelopt(quant)
    if method == "fp8":
        return _serialized_fp8(quant)
    raise ValueError(
        f"quantization_config quant_method={quant.get('quant_method')!r} is not supported; "
        f"supported: {SUPPORTED}"
    )


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantization_config: {what} is not supported; supported: {SUPPORTED}")


def _compressed_tensors(quant: dict[str, Any]) -> Fp8Scheme:
    fmt = quant.get("format")
    if fmt != "float-quantized":
        raise _refuse(f"compressed-tensors format {fmt!r}")
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"compressed-tensors quantization_status {status!r} (weights not in fp8)")
    for extra in ("sparsity_config", "transform_config"):
        if quant.get(extra):
            raise _refuse(f"compressed-tensors {extra}")
    groups = list((quant.get("config_groups") or {}).values())
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    schemes, targets = set(), []
    for group in groups:
        if group.get("format") not in (None, "float-quantized"):
            raise _refuse(f"compressed-tensors group format {group.get('format')!r}")
        if group.get("output_activations"):
            raise _refuse("compressed-tensors output_activations")
        schemes.add(_ct_group(group.get("weights"), group.get("input_activations")))
        targets += list(group.get("targets") or [])
    if len(schemes) > 1:
        raise _refuse(f"compressed-tensors with several schemes ({len(schemes)} config_groups)")
    weight, act, static = schemes.pop()
    return Fp8Scheme(
        weight_scale=weight,
        activation_scale=act,
        static_input_scale=static,
        checkpoint_format="compressed-tensors",
        targets=tuple(targets) or ("Linear",),
        ignore=tuple(quant.get("ignore") or ()),
    )


def _fp8_args(args: dict[str, Any], what: str) -> str:
    """The strategy of compressed-tensors QuantizationArgs that are symmetric 8-bit float."""
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise _refuse(f"compressed-tensors {what} type={args.get('type')!r} "
                      f"num_bits={args.get('num_bits')!r}")  # fmt: skip
    if not args.get("symmetric", True):
        raise _refuse(f"compressed-tensors asymmetric {what}")
    strategy = args.get("strategy")
    if (
        strategy in ("block", "group", "tensor_group")
        or args.get("block_structure")
        or (args.get("group_size"))
    ):
        raise _refuse(
            f"compressed-tensors {what} strategy {strategy!r} (block_structure="
            f"{args.get('block_structure')!r}, group_size={args.get('group_size')!r})"
        )
    return str(strategy)


def _ct_group(weights: dict | None, inputs: dict | None) -> tuple[str, str, bool]:
    if not weights:
        raise _refuse("compressed-tensors without weight quantization")
    if inputs is None:
        raise _refuse("compressed-tensors weight-only fp8 (input_activations null)")
    weight = _fp8_args(weights, "weights")
    if weight not in WEIGHT_SCALES or weights.get("dynamic"):
        raise _refuse(f"compressed-tensors weights strategy {weight!r}")
    act = _fp8_args(inputs, "input_activations")
    dynamic = bool(inputs.get("dynamic"))
    if act == "token" and dynamic:
        return weight, "token", False
    if act == "tensor":
        return weight, "tensor", not dynamic
    raise _refuse(f"compressed-tensors input_activations strategy {act!r} dynamic={dynamic}")


def _modelopt(quant: dict[str, Any]) -> Fp8Scheme:
    inner = quant.get("quantization")
    body = inner if isinstance(inner, dict) else quant
    algo = str(body.get("quant_algo") or "").upper()
    exclude = body.get("exclude_modules", quant.get("ignore")) or []
    if algo == "FP8":
        weight, act, static = "tensor", "tensor", True
    elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
        weight, act, static = "channel", "token", False
    else:
        raise _refuse(f"modelopt quant_algo {body.get('quant_algo')!r}")
    return Fp8Scheme(
        weight_scale=weight,
        activation_scale=act,
        static_input_scale=static,
        checkpoint_format="modelopt",
        ignore=tuple(exclude),
    )


def _serialized_fp8(quant: dict[str, Any]) -> Fp8Scheme:
    if quant.get("weight_block_size"):
        raise _refuse(f"fp8 weight_block_size={quant['weight_block_size']!r} (block-wise fp8)")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise _refuse(f"fp8 activation_scheme {scheme!r}")
    return Fp8Scheme(
        weight_scale="tensor",
        activation_scale="tensor",
        static_input_scale=scheme == "static",
        checkpoint_format="fp8",
        ignore=tuple(quant.get("ignored_layers") or quant.get("ignore") or ("lm_head",)),
    )


def resolve_scheme(
    checkpoint: Fp8Scheme | None, quantization: str | None, activation_scale: str
) -> Fp8Scheme | None:
    """The scheme a model runs: the checkpoint's, else with `quantization="fp8"` weights
    quantized at load (activation_scale "token" -> channel weight scales + dynamic per-token
    activations; "tensor" -> tensor weight scales + dynamic per-tensor activations).
    Raises ValueError for options that contradict the checkpoint."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(
            f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}"
        )
    if activation_scale not in FP8_ACTIVATION_SCALES:
        raise ValueError(
            f"fp8_activation_scale must be one of {FP8_ACTIVATION_SCALES}, got {activation_scale!r}"
        )
    if checkpoint is not None:
        if activation_scale not in ("auto", checkpoint.activation_scale):
            raise ValueError(
                f"fp8_activation_scale={activation_scale!r}: the checkpoint fixes "
                f"{checkpoint.activation_scale!r} ({checkpoint.describe()})"
            )
        return checkpoint
    if quantization is None:
        if activation_scale != "auto":
            raise ValueError(
                f"fp8_activation_scale={activation_scale!r} needs quantization='fp8' or an "
                "FP8 checkpoint"
            )
        return None
    token = activation_scale in ("auto", "token")
    return Fp8Scheme(
        weight_scale="channel" if token else "tensor",
        activation_scale="token" if token else "tensor",
    )
