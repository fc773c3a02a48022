"""Fast paged attention in plain torch: batched `scaled_dot_product_attention` (any device).

What `attention_backend="torch"` builds (the default without FlashInfer); the exact reference is
`TorchAttentionBackend` ("torch-reference"). `prepare` plans the step once (`sdpa_plan`: rows cut
into pieces, pieces packed into a few padded groups) and every layer runs, per group: one
`index_select` of the group's query tokens, one of its K blocks and one of its V blocks (into a
reused buffer, so no fresh pages per layer), one SDPA call with an additive mask (prefix + causal
over the new tokens, padding masked; made at the step's first layer) and one `index_copy_` of
the results.

GQA without repeated K/V: a decode group attends q viewed as [n, kv_heads, group, d] (the query
heads sharing a KV head become that head's queries); an extend group uses SDPA's `enable_gqa`.
Padding and memory are bounded by `PlanLimits` (see sdpa_plan). Numerics: SDPA in the input
dtype (float32 on CPU; bfloat16 accumulates in float32 inside the kernel). An fp8 pool is
gathered as stored (1 byte an element) and dequantized to q's dtype (`KVPool.dequantize`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixrt.attention.forward_batch import ForwardBatch
from radixrt.attention.sdpa_plan import DEFAULT_LIMITS, AttentionGroup, PlanLimits, plan_attention
from radixrt.kv.pool import KVPool


class SdpaAttentionBackend:
    """AttentionBackend over torch SDPA; see the module docstring."""

    supports_fp8_kv = True  # dequantizes after the gather (KVPool.dequantize)

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, limits: PlanLimits = DEFAULT_LIMITS
    ) -> None:
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.limits = limits
        self.batch: ForwardBatch | None = None
        self.groups: list[AttentionGroup] = []
        self._buffer: torch.Tensor | None = None  # gathered K then V of one group, reused
        self._masks: list[torch.Tensor] = []  # groups' masks as additive biases (0 / -inf)

    def prepare(self, batch: ForwardBatch) -> None:
        """Plan the step: build every group's gather indices and mask (used by all layers)."""
        self.batch = batch
        self.groups = plan_attention(
            batch, self.num_heads, self.num_kv_heads * self.head_dim, self.limits
        )
        self._masks = []

    def _bias(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        """Group i's mask as an additive bias in `dtype`, made at the step's first layer (SDPA
        would convert a boolean mask on every call)."""
        if not self._masks or self._masks[0].dtype != dtype:
            self._masks = [
                torch.zeros(g.mask.shape, dtype=dtype, device=g.mask.device).masked_fill_(
                    ~g.mask, float("-inf")
                )
                for g in self.groups
            ]
        return self._masks[i]

    def _gather_kv(
        self, grp: AttentionGroup, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's keys and values, [n, hkv, kv_len, d] each (views of a flat buffer that
        every layer and step reuses: grown when a group needs more, never shrunk)."""
        stored = k_cache.dtype
        if stored == torch.float8_e4m3fn:  # gather the bytes: no fp8 index kernels everywhere
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        nblk = grp.blocks.shape[0]
        half = nblk * k_cache[0].numel()
        buf = self._buffer
        if buf is None or buf.numel() < 2 * half or buf.dtype != k_cache.dtype:
            buf = self._buffer = k_cache.new_empty(2 * half)
        shape = (nblk, *k_cache.shape[1:])
        keys = torch.index_select(k_cache, 0, grp.blocks, out=buf[:half].view(shape))
        vals = torch.index_select(v_cache, 0, grp.blocks, out=buf[half : 2 * half].view(shape))
        n, kl, hkv, d = grp.num_pieces, grp.kv_len, self.num_kv_heads, self.head_dim
        keys, vals = keys.view(stored), vals.view(stored)
        return keys.view(n, kl, hkv, d).transpose(1, 2), vals.view(n, kl, hkv, d).transpose(1, 2)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        """Store k/v at the step's slots, then attend (see AttentionBackend.forward).
        q [T, hq, d], k/v [T, hkv, d] (last dim contiguous) -> [T, hq, d] in q's dtype."""
        batch = self.batch
        assert batch is not None, "prepare() must run before forward()"
        pool.store(layer, batch.slot_mapping, k, v)
        k_cache, v_cache = pool.k_cache(layer), pool.v_cache(layer)  # [blocks, B, hkv, d]
        hq, hkv, d, g = self.num_heads, self.num_kv_heads, self.head_dim, self.group_size
        groups = self.groups
        if len(groups) == 1 and groups[0].token_range == (0, q.shape[0]):  # decode-only step
            return self._decode(layer, groups[0], 0, q, k_cache, v_cache, pool)
        out = q.new_empty((q.shape[0] + 1, hq, d))  # row T: trash for padded queries
        for i, grp in enumerate(groups):
            if grp.token_range is not None:
                first, stop = grp.token_range
                out[first:stop] = self._decode(layer, grp, i, q, k_cache, v_cache, pool)
                continue
            n, ql = grp.num_pieces, grp.q_len
            keys, vals = self._gather_kv(grp, k_cache, v_cache)  # [n, hkv, kl, d]
            keys, vals = pool.dequantize(layer, keys, vals, q.dtype)  # fp8: x the scales
            qg = q.index_select(0, grp.q_index)  # [n * ql, hq, d]
            if ql == 1:  # decode: the heads of a KV head are its queries -> [n, hkv, g, d]
                res = F.scaled_dot_product_attention(
                    qg.view(n, hkv, g, d),
                    keys,
                    vals,
                    attn_mask=self._bias(i, q.dtype),
                    scale=self.scale,
                ).reshape(n, hq, d)
            else:
                res = F.scaled_dot_product_attention(
                    qg.view(n, ql, hq, d).transpose(1, 2),
                    keys,
                    vals,
                    attn_mask=self._bias(i, q.dtype),
                    scale=self.scale,
                    enable_gqa=g > 1,
                )  # [n, hq, ql, d]
                res = res.transpose(1, 2).reshape(n * ql, hq, d)
            out.index_copy_(0, grp.out_index, res)
        return out[:-1]

    def _decode(
        self,
        layer: int,
        grp: AttentionGroup,
        i: int,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pool: KVPool,
    ) -> torch.Tensor:
        """Group i of consecutive decode rows (`token_range`): q read in place, no scatter.
        Returns [n, hq, d] for tokens first..stop-1."""
        assert grp.token_range is not None
        first, stop = grp.token_range
        n, hkv, g, d = grp.num_pieces, self.num_kv_heads, self.group_size, self.head_dim
        keys, vals = self._gather_kv(grp, k_cache, v_cache)  # [n, hkv, kl, d]
        keys, vals = pool.dequantize(layer, keys, vals, q.dtype)  # fp8: x the scales
        qg = q[first:stop]
        if not qg.is_contiguous():
            qg = qg.contiguous()
        return F.scaled_dot_product_attention(
            qg.view(n, hkv, g, d), keys, vals, attn_mask=self._bias(i, q.dtype), scale=self.scale
        ).reshape(n, self.num_heads, d)
