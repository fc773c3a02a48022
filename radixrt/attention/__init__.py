"""Attention backends: torch (any device: native paged kernels on a float32 CPU pool,
batched SDPA otherwise), torch-reference (the exact oracle, any device) and flashinfer
(CUDA)."""

from __future__ import annotations

import torch

from radixrt.attention.base import AttentionBackend
from radixrt.config import ModelConfig


def create_attention_backend(
    kind: str,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    decode_kernel: str = "auto",
) -> AttentionBackend:
    """Build the backend named `kind` for a KV pool of `kv_dtype` (None: `dtype`); flashinfer
    is imported only when asked for. `decode_kernel` picks flashinfer's decode kernel
    (`radixrt.attention.flashinfer_backend.pick_decode_kernel`); other backends take "auto".
    Raises ValueError at once (not at the first forward) when the backend cannot run that KV
    dtype on this device."""
    if decode_kernel != "auto" and kind != "flashinfer":
        raise ValueError(
            f"decode_kernel={decode_kernel!r} is a flashinfer kernel; backend {kind!r}"
        )
    backend = _create(kind, cfg, device, dtype, kv_dtype, decode_kernel)
    if kv_dtype == torch.float8_e4m3fn and not backend.supports_fp8_kv:
        raise ValueError(
            f"attention_backend {kind!r} has no fp8 KV path; use kv_cache_dtype='auto' or "
            "a backend that supports fp8 (torch, torch-reference, flashinfer)"
        )
    return backend


def _create(
    kind: str,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None,
    decode_kernel: str,
) -> AttentionBackend:
    if kind == "torch":
        from radixrt.attention.sdpa_backend import SdpaAttentionBackend

        # decode rows through the native CPU kernel where it applies (float32 pool on a CPU)
        native = device.type == "cpu" and (kv_dtype or dtype) == dtype == torch.float32
        return SdpaAttentionBackend(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, native_decode=native
        )
    if kind == "torch-reference":
        from radixrt.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if kind == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        from radixrt.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(cfg, device, dtype, kv_dtype, decode_kernel)
    raise ValueError(
        f"attention_backend must be 'torch', 'torch-reference' or 'flashinfer', got {kind!r}"
    )


__all__ = ["AttentionBackend", "create_attention_backend"]
