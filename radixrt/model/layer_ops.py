"""The small per-layer ops of the decoder (norms with the residual add, SiLU-and-mul, RoPE
and the KV store), run one of these ways, chosen once when the model is built:

- `ModuleOps`: the modules of `radixrt.model.layers` (FlashInfer's fused add + RMSNorm,
  SiLU-and-mul and in-place RoPE on CUDA, torch on a CPU), then the attention backend's
  `forward`, which stores K/V with its own kernel before attending;
- `TritonOps` (CUDA): `radixrt.kernels`' Triton add + RMSNorm and SiLU-and-mul, and with the
  flashinfer backend (`FusedRopeStoreOps`) RoPE + KV store in one kernel (`rope_store_kv`)
  before the backend's `attend`: one launch fewer a layer. `RopeStoreOps` pairs that kernel
  with FlashInfer's norms and SiLU-and-mul, so that a benchmark can tell the two parts apart.
  FlashInfer's own RoPE + append (`rope_quantize_fp8_append_paged_kv_cache`) quantizes q to
  fp8 and writes only fp8 caches, which our bf16-q attention does not take.

`RADIXRT_FUSED_OPS` (read by `create_layer_ops`) picks the CUDA way: "flashinfer" (default,
`ModuleOps`, the path the GPU suite and RESULTS measured), "triton" (`FusedRopeStoreOps`) or
"triton-rope" (`RopeStoreOps`). The Triton ways become the default once a GPU run shows them
faster with the same tokens. CPU models always take the modules.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Protocol

import torch

from radixrt.kernels import HAS_TRITON, rmsnorm, rope_store_kv, silu_mul
from radixrt.model.layers import RMSNorm, RopeInputs, RotaryEmbedding, silu_and_mul

if TYPE_CHECKING:
    from radixrt.attention.base import AttentionBackend
    from radixrt.kv.pool import KVPool

logger = logging.getLogger(__name__)

FUSED_OPS_ENV = "RADIXRT_FUSED_OPS"
# its values, the first the default: FlashInfer's kernels and a separate store (the
# modules); every small op in Triton; FlashInfer's norms and SiLU-and-mul with Triton RoPE + store
FUSED_OPS = ("flashinfer", "triton", "triton-rope")


class LayerOps(Protocol):
    def add_rmsnorm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) for x [T, H] (residual None: (norm(x), x)).
        May write the pair into x and residual (FlashInfer's in-place kernel)."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * I] (gate | up) -> silu(gate) * up [T, I]."""
        ...

    def prepare_rope(
        self, rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor
    ) -> RopeInputs:
        """The step's rotary inputs for activations like x (once for all layers)."""
        ...

    def attention(
        self,
        layer: int,
        rope: RotaryEmbedding,
        rope_inputs: RopeInputs,
        q: torch.Tensor,  # [T, hq, d] (may be rotated in place)
        k: torch.Tensor,  # [T, hkv, d]
        v: torch.Tensor,  # [T, hkv, d]
        backend: AttentionBackend,
        pool: KVPool,
    ) -> torch.Tensor:
        """RoPE on q and k, K/V stored into the pool, attention: [T, hq, d]."""
        ...


class StoredKVAttention(Protocol):
    """What the fused RoPE + store needs of a backend (FlashInferBackend has it)."""

    @property
    def slots(self) -> torch.Tensor:
        """The planned step's KV slot of each new token [T] int64."""
        ...

    def attend(self, layer: int, q: torch.Tensor, pool: KVPool) -> torch.Tensor:
        """Attention of q [T, hq, d] over the pool, this step's K/V stored at `slots`."""
        ...


class ModuleOps:
    """The modules of radixrt.model.layers and the backend's store-then-attend."""

    def add_rmsnorm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return norm(x), x
        return norm(x, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def prepare_rope(
        self, rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor
    ) -> RopeInputs:
        return rope.prepare(positions, x)

    def attention(self, layer, rope, rope_inputs, q, k, v, backend, pool) -> torch.Tensor:
        q, k = rope(rope_inputs, q, k)
        return backend.forward(layer, q, k, v, pool)


class RopeStoreOps(ModuleOps):
    """The modules' norms and SiLU-and-mul (FlashInfer's on CUDA), and RoPE + KV store in
    one Triton kernel before the backend's `attend` (a backend that attends over K/V stored
    at its `slots`: flashinfer)."""

    def prepare_rope(
        self, rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor
    ) -> RopeInputs:
        return RopeInputs(positions, None, None)  # the kernel reads the cos/sin cache itself

    def attention(
        self,
        layer: int,
        rope: RotaryEmbedding,
        rope_inputs: RopeInputs,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        backend: StoredKVAttention,
        pool: KVPool,
    ) -> torch.Tensor:
        rope_store_kv(
            q,
            k,
            v,
            rope_inputs.positions,
            rope.cos_sin,
            pool.kv[layer],
            backend.slots,
            pool.k_scale(layer),
            pool.v_scale(layer),
        )
        return backend.attend(layer, q, pool)  # q was rotated in place


class TritonOps(ModuleOps):
    """radixrt.kernels' Triton add + RMSNorm and SiLU-and-mul; RoPE and the store as the
    modules and the backend run them (a backend without `attend`)."""

    def add_rmsnorm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, new_residual = rmsnorm(x, norm.weight, norm.eps, residual)
        return out, new_residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul(x)


class FusedRopeStoreOps(TritonOps):
    """Every small op a Triton kernel: TritonOps' norms and SiLU-and-mul, RopeStoreOps'
    RoPE + KV store."""

    prepare_rope = RopeStoreOps.prepare_rope
    attention = RopeStoreOps.attention


def create_layer_ops(device: torch.device, attention_backend: str) -> LayerOps:
    """The layer ops of a model on `device` whose attention runs on `attention_backend`:
    on CUDA as `RADIXRT_FUSED_OPS` says (ValueError naming the allowed values otherwise;
    RoPE + KV store fuse only with the flashinfer backend), else the modules."""
    if device.type != "cuda":
        return ModuleOps()
    choice = os.environ.get(FUSED_OPS_ENV, FUSED_OPS[0])
    if choice not in FUSED_OPS:
        raise ValueError(f"{FUSED_OPS_ENV} must be one of {FUSED_OPS}, got {choice!r}")
    fuse_rope_store = attention_backend == "flashinfer"
    if (
        not HAS_TRITON
        or choice == "flashinfer"
        or (choice == "triton-rope" and not fuse_rope_store)
    ):
        ops: LayerOps = ModuleOps()
    elif choice == "triton-rope":
        ops = RopeStoreOps()
    else:
        ops = FusedRopeStoreOps() if fuse_rope_store else TritonOps()
    logger.info("layer ops: %s", type(ops).__name__)
    return ops
