"""PEFT LoRA adapters of the tiny model, made with PEFT itself: random init, then a few
training steps on the model's own text (so A and B are both trained and outputs differ from
the base model's)."""

from __future__ import annotations

import json
import os

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (r, lora_alpha, target modules, use_rslora)
ADAPTERS = {
    "all8": (8, 16, ATTN + MLP, False),
    "qv4": (4, 8, ["q_proj", "v_proj"], False),
    "rs16": (16, 8, ATTN + MLP, True),
    "mlp2": (2, 4, MLP, False),
}
TRAIN_TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time there was a cat."


def make_adapter(base_dir: str, out_dir: str, name: str, seed: int) -> str:
    """Make adapter `name` of ADAPTERS for the model in `base_dir`, saved in out_dir/name."""
    import peft
    import transformers

    r, alpha, targets, rslora = ADAPTERS[name]
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,  # random A and B: a visible delta from the first step
        lora_dropout=0.0,
    )
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # random init of a size that moves greedy outputs, not noise
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.5 / max(p.shape) ** 0.5)
    tok = transformers.AutoTokenizer.from_pretrained(base_dir)
    ids = torch.tensor([tok.encode(TRAIN_TEXT)])
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    path = os.path.join(out_dir, name)
    model.save_pretrained(path)
    return path


def make_adapters(base_dir: str, out_dir: str) -> dict[str, str]:
    """Every adapter of ADAPTERS: name -> directory."""
    return {name: make_adapter(base_dir, out_dir, name, i) for i, name in enumerate(ADAPTERS)}


def edit_config(path: str, **fields) -> None:
    """Rewrite fields of the adapter_config.json in `path`."""
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(fields)
    with open(file, "w") as f:
        json.dump(config, f)


def write_random_adapter(model_dir: str, path: str, r: int = 4, seed: int = 0) -> str:
    """A PEFT-format adapter of random weights for every served projection of the model in
    `model_dir`, written without PEFT (tests that need an adapter, not PEFT's numerics)."""
    from safetensors.torch import save_file

    from radixrt.config import ModelConfig
    from radixrt.lora.adapter import module_shapes

    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(ModelConfig.from_pretrained(model_dir))
    tensors = {}
    for layer in range(ModelConfig.from_pretrained(model_dir).num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            kind = "self_attn" if module in ATTN else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen) * 0.1
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": ATTN + MLP,
        "base_model_name_or_path": model_dir,
        "bias": "none",
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path
