"""Model construction: HF checkpoints or random ("dummy") weights."""

from __future__ import annotations

import torch

from radixrt.config import ModelConfig
from radixrt.model.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(
    cfg: ModelConfig,
    model_path: str,
    *,
    device: str,
    dtype: str,
    load_format: str,
    max_positions: int,
    seed: int = 0,
) -> LlamaForCausalLM:
    """Create the model directly on `device` in `dtype` and fill its weights."""
    torch_dtype = DTYPES[dtype]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, max_positions)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        model.init_dummy_weights(seed)
    else:
        from radixrt.model.loader import iterate_hf_weights

        model.load_weights(iterate_hf_weights(model_path))
    return model.eval()


__all__ = ["DTYPES", "LlamaForCausalLM", "build_model"]
