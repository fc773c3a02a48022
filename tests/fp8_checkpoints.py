"""FP8 checkpoints of a model dir, written for tests by tools other than radixrt's loader.

- `write_llmcompressor`: llm-compressor's FP8_DYNAMIC recipe (compressed-tensors
  `float-quantized`, channel weight scales, dynamic per-token activations), lm_head ignored;
  the reference writer, from the package index (None when llmcompressor is not installed).
- `write_modelopt`: the ModelOpt FP8 layout as vLLM's and SGLang's loaders read it
  (per-tensor fp32 `weight_scale` and static `input_scale` scalars beside each fp8
  `*.weight`, `k_proj.k_scale` / `v_proj.v_scale`, lm_head excluded), with the config in
  `hf_quant_config.json` (legacy) or in config.json's `quantization_config`. Written here
  with its own quantization code (torch ops only); input scales come from calibration
  (max |input| / 448 of each linear over a few token sequences, through transformers).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0


def _copy_dir(src: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json",):
            shutil.copy(os.path.join(src, name), out)


def write_llmcompressor(src: str, out: str) -> str | None:
    """`src` quantized by llm-compressor's FP8_DYNAMIC recipe into `out` (bf16 load, as its
    examples do), or None when llmcompressor is not installed."""
    if importlib.util.find_spec("llmcompressor") is None:
        return None
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(out, save_compressed=True)
    _copy_dir(src, out)
    return out


def calibrate(src: str, sequences: list[list[int]]) -> dict[str, float]:
    """max |input| of every decoder linear (HF module name -> float) over `sequences`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:

            def hook(_m, args, _out, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())

            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for ids in sequences:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax


def write_modelopt(src: str, out: str, sequences: list[list[int]], legacy: bool = True) -> str:
    """`src` in ModelOpt's FP8 layout (see the module docstring) into `out`."""
    from safetensors.torch import load_file, save_file

    amax = calibrate(src, sequences)
    tensors = {}
    for path in sorted(os.listdir(src)):
        if path.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, path)))
    written = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            w = t.float()
            scale = w.abs().max() / E4M3_MAX
            written[name] = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            written[module + ".weight_scale"] = scale.reshape(()).float()
            written[module + ".input_scale"] = torch.tensor(amax[module] / E4M3_MAX)
            if module.endswith(("k_proj", "v_proj")):
                kind = module[-6]  # "k" or "v"
                written[f"{module}.{kind}_scale"] = torch.tensor(1.0)
        else:
            written[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    os.makedirs(out, exist_ok=True)
    save_file(written, os.path.join(out, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    if legacy:
        with open(os.path.join(out, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt", "version": "0.0"}, "quantization": quant},
                      f)  # fmt: skip
    else:
        config["quantization_config"] = {"quant_method": "modelopt", **quant}
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    _copy_dir(src, out)
    return out
