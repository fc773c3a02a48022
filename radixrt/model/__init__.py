"""Model construction: HF checkpoints or random ("dummy") weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixrt.config import ModelConfig
from radixrt.model.linear import prepack_linears
from radixrt.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from radixrt.model.tp.group import TPGroup
    from radixrt.model.tp.shard import TPShard

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
    shard: TPShard | None = None,
    group: TPGroup | None = None,
    prepack: bool = True,
) -> LlamaForCausalLM:
    """Create the model directly on `device` in `dtype` and fill its weights. With `group`
    (tensor parallelism): this rank's `shard`, reading only its slices of the checkpoint.
    A float32 CPU model gets oneDNN-packed copies of its linear weights
    (`radixrt.model.linear`: used for prefill-sized inputs) unless `prepack` is False."""
    torch_dtype = DTYPES[dtype]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, max_positions, shard, group)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        model.init_dummy_weights(seed)
    elif group is None:
        from radixrt.model.loader import iterate_hf_weights

        model.load_weights(iterate_hf_weights(model_path))
    else:
        from radixrt.model.loader import iterate_hf_weight_slices

        model.load_weights(iterate_hf_weight_slices(model_path))
    if prepack:
        prepack_linears(model)
    return model.eval()


__all__ = ["DTYPES", "LlamaForCausalLM", "build_model"]
