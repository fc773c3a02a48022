"""Attention backends: torch (batched SDPA, any device), torch-reference (the exact oracle,
any device) and flashinfer (CUDA)."""

from __future__ import annotations

import torch

from radixrt.attention.base import AttentionBackend
from radixrt.config import ModelConfig


def create_attention_backend(
    kind: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> AttentionBackend:
    """Build the backend named `kind`; flashinfer is imported only when asked for."""
    if kind == "torch":
        from radixrt.attention.sdpa_backend import SdpaAttentionBackend

        return SdpaAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if kind == "torch-reference":
        from radixrt.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if kind == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        from radixrt.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(cfg, device, dtype)
    raise ValueError(
        f"attention_backend must be 'torch', 'torch-reference' or 'flashinfer', got {kind!r}"
    )


__all__ = ["AttentionBackend", "create_attention_backend"]
