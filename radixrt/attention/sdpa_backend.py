"""Fast paged attention in plain torch: batched `scaled_dot_product_attention` (any device).

What `attention_backend="torch"` builds (the default without FlashInfer); the exact reference is
`TorchAttentionBackend` ("torch-reference"). `prepare` plans the step once (`sdpa_plan`: rows cut
into pieces, pieces packed into a few padded groups) and every layer runs, per group: one
`index_select` of the group's query tokens, one of its K blocks and one of its V blocks (into a
reused buffer, so no fresh pages per layer), one SDPA call with an additive mask (prefix + causal
over the new tokens, padding masked; made at the step's first layer) and one `index_copy_` of
the results. Decode groups list their rows in order, so a group of consecutive rows reads q in
place and a decode-only step returns SDPA's output as it is.

Shared prefixes (CPU): rows whose block tables start with the same blocks attend those blocks
together, one SDPA call per prefix group, and their other blocks in the groups above; the two
partial results are merged by log-sum-exp (`sdpa_prefix`; the SDPA calls then go through
torch's CPU flash kernel directly, which also returns the log-sum-exp).

On a CPU with a float32 pool (`native_decode`) the native kernels attend the rows over their
blocks in place, one call each per layer, with no gathered copy (`native_rows`): the decode
kernel (`radixrt.kernels.paged_decode_cpu`) every decode row, the extend kernel
(`radixrt.kernels.paged_extend_cpu`) every extend row (causal, queries tiled). Where the
extend kernel did not build, the decode kernel also takes the small extend rows
(`native_max_extend_pairs`; one query per token) and only the other rows are planned into
groups (and prefix groups); where neither builds (no C compiler) every row takes the SDPA
groups.

Extend groups whose pieces all start at key 0 (a fresh prompt's whole rows) run SDPA's own
causal mask (`is_causal`) instead of an additive one: no mask to build at the first layer or
read in every call (torch's CPU flash kernel took as long either way at 128 keys, a little less
with `is_causal` at 512).

GQA without repeated K/V: a decode group attends q viewed as [n, kv_heads, group, d] (the query
heads sharing a KV head become that head's queries; on a CPU a group of 3 mod 4 heads gets one
zero query more, which the flash kernel runs faster: `decode_group`); an extend group uses SDPA's
`enable_gqa`.
Padding and memory are bounded by `PlanLimits` (see sdpa_plan). Numerics: SDPA in the input
dtype (float32 on CPU; bfloat16 accumulates in float32 inside the kernel). An fp8 pool is
gathered as stored (1 byte an element) and dequantized to q's dtype (`KVPool.dequantize`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixrt.attention.forward_batch import ForwardBatch
from radixrt.attention.native_rows import (
    NATIVE_MAX_EXTEND_PAIRS,
    NativePlan,
    attend_native,
    plan_native,
)
from radixrt.attention.sdpa_plan import DEFAULT_LIMITS, AttentionGroup, PlanLimits, plan_attention
from radixrt.attention.sdpa_prefix import (
    MIN_SAVED_KEYS,
    PrefixGroup,
    merge_partial,
    plan_shared_prefixes,
)
from radixrt.kernels.paged_decode_cpu import PagedDecodeKernel, load_paged_decode
from radixrt.kernels.paged_extend_cpu import PagedExtendKernel, load_paged_extend
from radixrt.kv.pool import KVPool


class SdpaAttentionBackend:
    """AttentionBackend over torch SDPA; see the module docstring."""

    supports_fp8_kv = True  # dequantizes after the gather (KVPool.dequantize)
    supports_cuda_graph = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        limits: PlanLimits = DEFAULT_LIMITS,
        shared_prefix: bool = True,
        prefix_min_saved_keys: int = MIN_SAVED_KEYS,
        native_decode: bool = False,
        native_max_extend_pairs: int = NATIVE_MAX_EXTEND_PAIRS,
        native_extend: bool = True,
    ) -> None:
        """`shared_prefix`: attend rows' shared prefix blocks together on a CPU (`sdpa_prefix`,
        groups saving at least `prefix_min_saved_keys` key reads); False (and on other
        devices): every row over all of its blocks. `native_decode`: decode rows (and extend
        rows of at most `native_max_extend_pairs` (query, key) pairs) of CPU batches through
        the native kernel (the pool must then be float32; see the module docstring);
        `native_extend`: extend rows through the extend kernel (False: as where it did not
        build)."""
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_head_dim = head_dim  # the pool stores the model's heads as they are
        self.group_size = num_heads // num_kv_heads
        # decode queries per KV head as SDPA sees them: one zero query more when that makes a
        # multiple of 4 (CPU flash kernel, 32 rows x 160 keys, 2 KV heads: 0.28 ms at 3 queries,
        # 0.17 at 4; 7 -> 8 also gains; 2, 5, 6 do not: benchmarks/bench_cpu_paired.py)
        self.decode_group = self.group_size + (1 if self.group_size % 4 == 3 else 0)
        self.scale = head_dim**-0.5
        self.limits = limits
        self.batch: ForwardBatch | None = None
        self.groups: list[AttentionGroup] = []
        self._buffer: torch.Tensor | None = None  # gathered K then V of one group, reused
        self._masks: list[torch.Tensor] = []  # groups' masks as additive biases (0 / -inf)
        self.shared_prefix = shared_prefix
        self.prefix_min_saved_keys = prefix_min_saved_keys
        self.prefix_groups: list[PrefixGroup] = []
        self.native_decode = native_decode
        if native_decode:
            load_paged_decode()  # build them now (start-up), not in the first request's step
            load_paged_extend()
        self.native_max_extend_pairs = native_max_extend_pairs
        self.native_extend = native_extend
        self._native: PagedDecodeKernel | None = None  # this step's kernel, if it runs rows
        self._extend: PagedExtendKernel | None = None  # the extend kernel, where it built
        self.native_plan: NativePlan | None = None  # the rows it runs

    def prepare(self, batch: ForwardBatch) -> None:
        """Plan the step: build every group's gather indices and mask (used by all layers)."""
        self.batch = batch
        skip = None
        self.prefix_groups = []
        self._masks = []
        on_cpu = batch.kv_indices.device.type == "cpu"
        kernel = load_paged_decode() if self.native_decode and on_cpu else None
        self._extend = load_paged_extend() if kernel is not None and self.native_extend else None
        self.native_plan = None
        if kernel is not None:
            self.native_plan = plan_native(
                batch, self.native_max_extend_pairs, self._extend is not None
            )
        self._native = kernel if self.native_plan is not None else None
        leave_out = None if self.native_plan is None else self.native_plan.rows
        if leave_out is not None and leave_out.all():  # every row through the kernel
            self.groups = []
            return
        if self.shared_prefix and on_cpu:
            plan = plan_shared_prefixes(
                batch, min_saved_keys=self.prefix_min_saved_keys, leave_out=leave_out
            )
            self.prefix_groups, skip = plan.groups, plan.skip_blocks
        self.groups = plan_attention(
            batch,
            self.num_heads,
            self.num_kv_heads * self.head_dim,
            self.limits,
            skip if self.prefix_groups else None,
            leave_out=leave_out,
        )

    def _bias(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        """Group i's mask as an additive bias in `dtype`, made at the step's first layer (SDPA
        would convert a boolean mask on every call); empty for a causal group."""
        if not self._masks or self._masks[0].dtype != dtype:
            self._masks = [
                torch.zeros(g.mask.shape, dtype=dtype, device=g.mask.device).masked_fill_(
                    ~g.mask, float("-inf")
                )
                for g in self.groups
            ]
        return self._masks[i]

    def _gather_kv(
        self,
        blocks: torch.Tensor,
        n: int,
        kv_len: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `blocks` (n pieces of kv_len keys each), [n, hkv, kv_len, d] each
        (views of a flat buffer that every layer and step reuses: grown when a call needs more,
        never shrunk)."""
        stored = k_cache.dtype
        if stored == torch.float8_e4m3fn:  # gather the bytes: no fp8 index kernels everywhere
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        nblk = blocks.shape[0]
        half = nblk * k_cache[0].numel()
        buf = self._buffer
        if buf is None or buf.numel() < 2 * half or buf.dtype != k_cache.dtype:
            buf = self._buffer = k_cache.new_empty(2 * half)
        shape = (nblk, *k_cache.shape[1:])
        keys = torch.index_select(k_cache, 0, blocks, out=buf[:half].view(shape))
        vals = torch.index_select(v_cache, 0, blocks, out=buf[half : 2 * half].view(shape))
        hkv, d = self.num_kv_heads, self.head_dim
        keys, vals = keys.view(stored), vals.view(stored)
        return keys.view(n, kv_len, hkv, d).transpose(1, 2), vals.view(n, kv_len, hkv, d).transpose(
            1, 2
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        """Store k/v at the step's slots, then attend (see AttentionBackend.forward).
        q [T, hq, d], k/v [T, hkv, d] (last dim contiguous) -> [T, hq, d] in q's dtype."""
        batch = self.batch
        assert batch is not None, "prepare() must run before forward()"
        pool.store(layer, batch.slot_mapping, k, v)
        k_cache, v_cache = pool.k_cache(layer), pool.v_cache(layer)  # [blocks, B, hkv, d]
        hq, d, g = self.num_heads, self.head_dim, self.group_size
        groups, prefixes = self.groups, self.prefix_groups
        num_tokens = q.shape[0]
        only = groups[0] if len(groups) == 1 and not prefixes and self._native is None else None
        if only is not None and only.q_len == 1 and only.token_range == (0, num_tokens):
            return self._decode(layer, only, 0, q, k_cache, v_cache, pool, False)[0]
        if self._native is not None and not groups:  # every row through the kernel
            out = q.new_empty((num_tokens, hq, d))
            self._attend_native(q, k_cache, v_cache, out)
            return out
        out = q.new_empty((num_tokens + 1, hq, d))  # row T: trash for padded queries
        if self._native is not None:
            self._attend_native(q, k_cache, v_cache, out)
        # log-sum-exps of the decode rows' partial results (merged with their prefixes')
        lse = q.new_empty((num_tokens + 1, hq), dtype=torch.float32) if prefixes else None
        for i, grp in enumerate(groups):
            if grp.q_len == 1:
                res, res_lse = self._decode(
                    layer, grp, i, q, k_cache, v_cache, pool, bool(prefixes)
                )
                if grp.token_range is not None:
                    first, stop = grp.token_range
                    out[first:stop] = res
                    if lse is not None:
                        lse[first:stop] = res_lse
                else:
                    out.index_copy_(0, grp.out_index, res)
                    if lse is not None:
                        lse.index_copy_(0, grp.out_index, res_lse)
                continue
            n, ql, span = grp.num_pieces, grp.q_len, grp.token_range
            keys, vals = self._gather_kv(grp.blocks, n, grp.kv_len, k_cache, v_cache)
            keys, vals = pool.dequantize(layer, keys, vals, q.dtype)  # fp8: x the scales
            qg = q[span[0] : span[1]] if span is not None else q.index_select(0, grp.q_index)
            qg = qg.view(n, ql, hq, d).transpose(1, 2)
            bias = None if grp.causal else self._bias(i, q.dtype)
            if lse is None:
                res = F.scaled_dot_product_attention(
                    qg,
                    keys,
                    vals,
                    attn_mask=bias,
                    is_causal=grp.causal,
                    scale=self.scale,
                    enable_gqa=g > 1,
                )  # [n, hq, ql, d]
            else:
                res, res_lse = _sdpa_with_lse(qg, keys, vals, bias, self.scale, grp.causal)
                res_lse = res_lse.transpose(1, 2)  # [n, ql, hq]
                if span is not None:
                    lse[span[0] : span[1]].view(n, ql, hq).copy_(res_lse)
                else:
                    lse.index_copy_(0, grp.out_index, res_lse.reshape(n * ql, hq))
            res = res.transpose(1, 2)  # [n, ql, hq, d]
            if span is not None:  # the group's queries are these tokens, in order
                if span == (0, num_tokens) and only is not None:
                    return res.reshape(num_tokens, hq, d)
                out[span[0] : span[1]].view(n, ql, hq, d).copy_(res)
            else:
                out.index_copy_(0, grp.out_index, res.reshape(n * ql, hq, d))
        for pg in prefixes:
            assert lse is not None
            res, res_lse = self._prefix(layer, pg, q, k_cache, v_cache, pool)
            merged = merge_partial(out[pg.tokens], lse[pg.tokens], res, res_lse)
            out.index_copy_(0, pg.tokens, merged)
        return out[:-1]

    def _attend_native(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
    ) -> None:
        assert self._native is not None and self.native_plan is not None and self.batch
        attend_native(
            self._native,
            self.native_plan,
            self.batch,
            q,
            k_cache,
            v_cache,
            self.scale,
            out,
            self._extend,
        )

    def _decode(
        self,
        layer: int,
        grp: AttentionGroup,
        i: int,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pool: KVPool,
        with_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode group i: the heads of a KV head are its queries ([n, hkv, g, d]); q read in
        place for consecutive rows (`token_range`). Returns ([n, hq, d], with `with_lse` the
        log-sum-exps [n, hq] float32, else None)."""
        n, hkv, g, d = grp.num_pieces, self.num_kv_heads, self.group_size, self.head_dim
        keys, vals = self._gather_kv(grp.blocks, n, grp.kv_len, k_cache, v_cache)
        keys, vals = pool.dequantize(layer, keys, vals, q.dtype)  # fp8: x the scales
        if grp.token_range is not None:
            qg = q[grp.token_range[0] : grp.token_range[1]]
            qg = qg if qg.is_contiguous() else qg.contiguous()
        else:
            qg = q.index_select(0, grp.q_index)
        qg, bias = qg.view(n, hkv, g, d), self._bias(i, q.dtype)
        if self.decode_group > g and q.is_cpu:  # zero queries more: results dropped
            qg = F.pad(qg, (0, 0, 0, self.decode_group - g))
        if not with_lse:
            res = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=bias, scale=self.scale)
            return res[:, :, :g].reshape(n, self.num_heads, d), None
        res, res_lse = _sdpa_with_lse(qg, keys, vals, bias, self.scale)
        return res[:, :, :g].reshape(n, self.num_heads, d), res_lse[:, :, :g].reshape(
            n, self.num_heads
        )

    def _prefix(
        self,
        layer: int,
        pg: PrefixGroup,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pool: KVPool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefix group's new tokens over their shared blocks, all query heads of a KV head
        in one problem ([1, hkv, Q * g, d]; no mask: every key is before every query).
        Returns ([Q, hq, d], log-sum-exps [Q, hq] float32)."""
        hkv, g, d = self.num_kv_heads, self.group_size, self.head_dim
        nq = pg.tokens.shape[0]
        kv_len = pg.blocks.shape[0] * pool.block_size
        keys, vals = self._gather_kv(pg.blocks, 1, kv_len, k_cache, v_cache)
        keys, vals = pool.dequantize(layer, keys, vals, q.dtype)
        qs = q.index_select(0, pg.tokens).view(nq, hkv, g, d).transpose(0, 1)
        res, res_lse = _sdpa_with_lse(qs.reshape(1, hkv, nq * g, d), keys, vals, None, self.scale)
        res = res.view(hkv, nq, g, d).transpose(0, 1).reshape(nq, self.num_heads, d)
        return res, res_lse.view(hkv, nq, g).transpose(0, 1).reshape(nq, self.num_heads)


def _sdpa_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA on CPU that also returns the log-sum-exp of the scaled scores: ([B, H, L, d],
    [B, H, L] float32), torch's CPU flash kernel."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale
    )
    return out, lse.float()
