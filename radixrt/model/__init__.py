"""Model construction: HF checkpoints or random ("dummy") weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixrt.config import ModelConfig
from radixrt.model.fp8_linear import check_fp8_capability
from radixrt.model.layer_ops import create_layer_ops
from radixrt.model.linear import prepack_linears
from radixrt.model.llama import LlamaForCausalLM
from radixrt.quantization import Fp8Scheme

if TYPE_CHECKING:
    from radixrt.model.tp.group import TPGroup
    from radixrt.tp_shard import TPShard

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
    fp8: Fp8Scheme | None = None,
    attention_backend: str = "torch",
) -> LlamaForCausalLM:
    """Create the model directly on `device` in `dtype` and fill its weights. With `group`
    (tensor parallelism): this rank's `shard`, reading only its slices of the checkpoint.
    With `fp8` the decoder's linears are `Fp8Linear` (radixrt.model.fp8_linear): fp8 on
    CUDA, dequantized into `dtype` once loaded on a CPU. A float32 CPU model gets
    oneDNN-packed copies of its linear weights (`radixrt.model.linear`: used for
    prefill-sized inputs) unless `prepack` is False. Its layer ops (norms, SiLU-and-mul, RoPE
    and the KV store: `radixrt.model.layer_ops`) are chosen here for `device` and the
    attention backend the runner will pair it with."""
    torch_dtype = DTYPES[dtype]
    if fp8 is not None:
        check_fp8_capability(torch.device(device))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            ops = create_layer_ops(torch.device(device), attention_backend)
            model = LlamaForCausalLM(cfg, max_positions, shard, group, fp8, ops)
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
    model.finish_loading(dequantize=torch.device(device).type != "cuda")
    if fp8 is not None and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # quantization temporaries back to the driver: KV sizing
    if prepack:
        prepack_linears(model)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as held (fp8 weights at 1 byte)."""
    tensors = [*model.parameters(), *model.buffers()]
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


__all__ = ["DTYPES", "LlamaForCausalLM", "build_model", "weight_bytes"]
