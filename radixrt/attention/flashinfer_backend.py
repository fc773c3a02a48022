"""FlashInfer paged attention (CUDA only): plan once per step, run per layer.

Decode rows (q_len 1) go through `BatchDecodeWithPagedKVCacheWrapper` with tensor cores,
extend rows (prefill chunks over a cached prefix) through
`BatchPrefillWithPagedKVCacheWrapper` (causal over the paged cache, prefix included); a mixed
batch runs both wrappers in one forward. KV layout is NHD (`KVPool.k_cache(layer)`); new K/V
are written by the Triton `store_kv` kernel before attending.

CUDA graphs (decode-only steps): one decode wrapper per batch-size bucket, built with
`use_cuda_graph=True` over fixed index buffers that all buckets share. `prepare_cuda_graph`
plans it (outside the graph) right before the graph is replayed.

Head dims: FlashInfer's kernels take 64, 128 or 256. Smaller heads (test models) are
zero-padded to `kv_head_dim`: the KV pool must then be allocated with `kv_head_dim` (the
runner does), q/k/v are padded before the kernels and the output is cut back. Zero columns
change neither q.k nor the first `head_dim` output columns.

fp8 KV (`kv_dtype=torch.float8_e4m3fn`, q stays bf16/fp16): the prefill wrapper is planned
with `kv_data_type=fp8` on the fa2 backend (FlashInfer's fa3 refuses fp8 KV with a non-fp8 q:
`is_fa3_backend_supported` in 0.6.13, so "auto" would pick fa2 as well; pinning it keeps one
JIT module per head dim). `store_kv` quantizes with the pool's per-layer scales; K's scale
goes into the kernels' softmax scale, V's multiplies the output here (attention is linear in
V); scales of 1.0 cost nothing. Needs compute capability >= 8.9 (Triton's fp8 cast), checked
at construction.

Decode rows over an fp8 cache on Hopper (`decode_kernel="auto"`, compute capability 9.x, block
size 16/32/64/128) run FlashInfer's XQA kernel (TensorRT-LLM's decode attention), which reads
the cache through a padded block table (`radixrt.kernels.build_block_table`, one small kernel
per step) and needs no plan. Its Hopper fp8 kernel computes Q.K and P.V on fp8 tensor cores
(q and the softmax weights rounded to e4m3): on the Llama-3-8B shape it reads the cache at
~3.7 TB/s where fa2 reads fp8 at ~1.9 (no faster than bf16), at ~3.6% relative error of the
attention output against float32 over the same cache, where fa2's is ~0.2%
(`benchmarks/bench_decode_attention.py`). `decode_kernel="fa2"` keeps fa2 (bf16 q) for fp8
decode rows too; bf16 caches always use fa2 (XQA is no faster there past ~32 rows).

This module imports flashinfer at construction; CPU-only code never imports it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixrt.attention.forward_batch import ForwardBatch
from radixrt.config import DECODE_ATTENTION_KERNELS, XQA_BLOCK_SIZES, ModelConfig
from radixrt.kernels import build_block_table, store_kv
from radixrt.kv.pool import KVPool

SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 256 << 20  # float workspace shared by every wrapper (split-KV partials)
ATTENTION_BACKEND = "fa2"  # the tensor-core decode uses fa2 too: one JIT module per head dim
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: hardware fp8 conversions (Triton's float8e4nv)
# XQA's workspace: 8 MB of semaphores (zeroed once; the kernel leaves them zero) and scratch
# for the partial results of sequences split across CTAs. Its own buffer: fa2's partials
# would overwrite the semaphores.
XQA_WORKSPACE_BYTES = 256 << 20


def pick_decode_kernel(choice: str, kv_dtype: torch.dtype, capability: tuple[int, int]) -> str:
    """The decode kernel for `choice` ("auto", "fa2", "xqa"): "auto" is XQA for an fp8 cache
    on Hopper (measured there; see the module docstring), fa2 otherwise."""
    if choice not in DECODE_ATTENTION_KERNELS:
        raise ValueError(f"decode_kernel must be one of {DECODE_ATTENTION_KERNELS}, got {choice!r}")
    if choice == "auto":
        return "xqa" if kv_dtype == torch.float8_e4m3fn and capability[0] == 9 else "fa2"
    if choice == "xqa" and capability[0] < 9:
        raise ValueError(f"decode_kernel='xqa' needs compute capability >= 9.0, got {capability}")
    return choice


def kv_head_dim(head_dim: int) -> int:
    """Head dim of the KV pool for a model with `head_dim` (padded up to a supported one)."""
    for d in SUPPORTED_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(
        f"the flashinfer backend supports head_dim up to {SUPPORTED_HEAD_DIMS[-1]}, "
        f"got {head_dim}; use attention_backend='torch'"
    )


def _decode_seq_lens(seq_lens: torch.Tensor) -> torch.Tensor:
    """`seq_lens` argument for the tensor-core (fa2) decode plan: [max(seq_lens)] only.

    FlashInfer 0.6's plan reads it for `max(...)` alone, a Python max over a CPU tensor that
    costs ~4 us per row (1 ms a step at 256 rows); its C++ plan ignores the array. Passing
    the max keeps `_max_kv_len` exact at one tensor op. Re-check when upgrading FlashInfer."""
    return seq_lens.max().reshape(1)


def check_fp8_kv_capability(capability: tuple[int, int], device_name: str) -> None:
    """Raise ValueError unless a GPU of `capability` can run fp8 KV on this backend."""
    if tuple(capability) < FP8_MIN_CAPABILITY:
        need = ".".join(map(str, FP8_MIN_CAPABILITY))
        raise ValueError(
            f"kv_cache_dtype='fp8_e4m3' with the flashinfer backend needs a GPU of compute "
            f"capability >= {need} (Ada, Hopper or newer); {device_name} is "
            f"{capability[0]}.{capability[1]}. Use kv_cache_dtype='auto'"
        )


class FlashInferBackend:
    """AttentionBackend over FlashInfer; see the module docstring."""

    supports_cuda_graph = True
    supports_fp8_kv = True

    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        decode_kernel: str = "auto",
    ) -> None:
        """`kv_dtype`: the KV pool's dtype (None: `dtype`; or torch.float8_e4m3fn);
        `decode_kernel`: see `pick_decode_kernel`."""
        import flashinfer

        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"the flashinfer backend needs dtype bfloat16 or float16, got {dtype}; "
                "use attention_backend='torch' for float32"
            )
        self._flashinfer = flashinfer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.kv_head_dim = kv_head_dim(cfg.head_dim)
        self.sm_scale = cfg.head_dim**-0.5
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        if self.kv_dtype == torch.float8_e4m3fn:
            check_fp8_kv_capability(
                torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
            )
        elif self.kv_dtype != dtype:
            raise ValueError(f"kv_dtype must be {dtype} or torch.float8_e4m3fn, got {kv_dtype}")
        self._decode_kernel_choice = decode_kernel
        self.decode_kernel = pick_decode_kernel(
            decode_kernel, self.kv_dtype, torch.cuda.get_device_capability(device)
        )
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._xqa_workspace: torch.Tensor | None = None
        if self.decode_kernel == "xqa":
            from flashinfer.decode import xqa_batch_decode_with_kv_cache

            self._xqa_run = xqa_batch_decode_with_kv_cache
            self._xqa_workspace = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True, backend=ATTENTION_BACKEND
        )
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=ATTENTION_BACKEND
        )
        # CUDA graphs: bucket size -> decode wrapper over the shared fixed buffers
        self._graph_wrappers: dict[int, object] = {}
        self._graph_indptr: torch.Tensor | None = None
        self._graph_indices: torch.Tensor | None = None
        self._graph_last_page_len: torch.Tensor | None = None
        self._graph_table: torch.Tensor | None = None  # XQA: [max batch, max blocks] int32
        self._graph_seq_lens: torch.Tensor | None = None  # XQA: [max batch] int32
        # Per-step state, set by prepare / prepare_cuda_graph
        self._slots: torch.Tensor | None = None  # [T] int64: KV slot of each new token
        self._num_decode = 0
        self._decode = None  # wrapper planned for rows [0, num_decode), or None
        self._prefill = None  # wrapper planned for the extend rows, or None
        self._xqa: tuple[torch.Tensor, torch.Tensor] | None = None  # decode rows' (table, lens)

    # ---- planning ----
    def _uses_xqa(self, page_size: int) -> bool:
        """Whether decode rows of this block size run XQA ("auto" falls back to fa2 for a
        block size XQA is not built for; an explicit "xqa" refuses it)."""
        if self.decode_kernel != "xqa":
            return False
        if page_size not in XQA_BLOCK_SIZES:
            if self._decode_kernel_choice == "auto":
                return False
            raise ValueError(
                f"the XQA decode kernel takes block sizes {XQA_BLOCK_SIZES}, got {page_size}; "
                "use one of them or decode_kernel='fa2'"
            )
        return True

    def _plan_args(self, page_size: int) -> dict[str, object]:
        return dict(
            num_qo_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            page_size=page_size,
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
        )

    def prepare(self, batch: ForwardBatch) -> None:
        """Plan both wrappers for this step from the batch's CPU copies (no host sync)."""
        nd, bs = batch.num_decode, batch.block_size
        qo, kvp, seq = batch.qo_indptr_cpu, batch.kv_indptr_cpu, batch.seq_lens_cpu
        last_page_len = seq - (kvp[1:] - kvp[:-1] - 1) * bs  # [R] int32, 1..bs
        split = int(kvp[nd])
        self._slots = batch.slot_mapping
        self._num_decode = nd
        self._decode = self._prefill = self._xqa = None
        args = self._plan_args(bs)
        if nd and self._uses_xqa(bs):
            width = int((kvp[1 : nd + 1] - kvp[:nd]).max())
            table = torch.empty((nd, width), dtype=torch.int32, device=self.device)
            build_block_table(batch.kv_indptr, batch.kv_indices, table, nd)
            self._xqa = (table, batch.seq_lens[:nd])
        elif nd:
            self.decode_wrapper.plan(
                kvp[: nd + 1],
                batch.kv_indices[:split],
                last_page_len[:nd],
                head_dim=self.kv_head_dim,
                seq_lens=_decode_seq_lens(seq[:nd]),
                **args,
            )
            self._decode = self.decode_wrapper
        if batch.num_extend:
            self.prefill_wrapper.plan(
                qo[nd:] - qo[nd],
                kvp[nd:] - split,
                batch.kv_indices[split:],
                last_page_len[nd:],
                head_dim_qk=self.kv_head_dim,
                causal=True,
                seq_lens=seq[nd:],
                **args,
            )
            self._prefill = self.prefill_wrapper

    def init_cuda_graph(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        """Allocate the index buffers shared by every bucket's graph decode wrapper (and
        XQA's block table)."""
        dev, i32 = self.device, torch.int32
        self._graph_indptr = torch.zeros(max_batch_size + 1, dtype=i32, device=dev)
        self._graph_indices = torch.zeros(
            max_batch_size * max_blocks_per_seq, dtype=i32, device=dev
        )
        self._graph_last_page_len = torch.ones(max_batch_size, dtype=i32, device=dev)
        if self.decode_kernel == "xqa":
            self._graph_table = torch.zeros(
                (max_batch_size, max_blocks_per_seq), dtype=i32, device=dev
            )
            self._graph_seq_lens = torch.ones(max_batch_size, dtype=i32, device=dev)

    def prepare_cuda_graph(
        self,
        batch_size: int,
        kv_indptr: torch.Tensor,  # [bs + 1] int32 cpu
        kv_indices: torch.Tensor,  # [kv_indptr[-1]] int32 cpu (pinned) or cuda
        kv_last_page_len: torch.Tensor,  # [bs] int32 cpu
        seq_lens: torch.Tensor,  # [bs] int32 cpu
        slot_mapping: torch.Tensor,  # [bs] int64 cuda: the graph's static slot buffer
        page_size: int,
        device_kv_indptr: torch.Tensor,  # [bs + 1] int32/int64 cuda: kv_indptr, staged
        device_seq_lens: torch.Tensor,  # [bs] cuda: seq_lens, staged
    ) -> None:
        """Plan bucket `batch_size`'s decode (all rows decode rows): the fa2 wrapper's plan,
        or for XQA its block table and lengths, built on the device from the staged indices
        (kv_indices on the device then). Call it before capturing that bucket's graph and
        before each replay."""
        assert self._graph_indptr is not None, "init_cuda_graph() must run first"
        self._slots = slot_mapping
        self._num_decode = batch_size
        self._prefill = None
        if self._uses_xqa(page_size):
            assert self._graph_table is not None and kv_indices.is_cuda
            table = build_block_table(device_kv_indptr, kv_indices, self._graph_table, batch_size)
            lens = self._graph_seq_lens[:batch_size]
            lens.copy_(device_seq_lens[:batch_size])
            self._xqa, self._decode = (table, lens), None
            return
        wrapper = self._graph_wrappers.get(batch_size)
        if wrapper is None:
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=self._graph_indptr[: batch_size + 1],
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=self._graph_last_page_len[:batch_size],
                backend=ATTENTION_BACKEND,
            )
            self._graph_wrappers[batch_size] = wrapper
        wrapper.plan(
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            head_dim=self.kv_head_dim,
            seq_lens=_decode_seq_lens(seq_lens),
            **self._plan_args(page_size),
        )
        self._decode, self._xqa = wrapper, None

    # ---- per layer ----
    @property
    def slots(self) -> torch.Tensor:
        """The planned step's KV slot of each new token [T] int64 (where `attend` expects
        its K/V to be stored already)."""
        assert self._slots is not None, "prepare() must run before the layers"
        return self._slots

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        """Store k/v at the step's slots, then attend (see AttentionBackend.forward).
        q [T, hq, d], k/v [T, hkv, d] (last dim contiguous; other strides free)."""
        pad = self.kv_head_dim - self.head_dim
        if pad:
            k, v = F.pad(k, (0, pad)), F.pad(v, (0, pad))
        store_kv(pool.kv[layer], self.slots, k, v, pool.k_scale(layer), pool.v_scale(layer))
        return self.attend(layer, q, pool)

    def attend(self, layer: int, q: torch.Tensor, pool: KVPool) -> torch.Tensor:
        """Attention of q [T, hq, d] over the pool, whose K/V of this step's tokens are stored
        at `slots` already (padded to kv_head_dim with zeros: `forward`, or a fused
        RoPE + store kernel). Returns [T, hq, d]."""
        pad = self.kv_head_dim - self.head_dim
        if pad:
            q = F.pad(q, (0, pad))
        assert pool.dtype == self.kv_dtype, "the pool's dtype is not the planned kv_data_type"
        k_scale, v_scale = pool.k_scale(layer), pool.v_scale(layer)
        kv_cache = (pool.k_cache(layer), pool.v_cache(layer))
        # FlashInfer folds k_scale into sm_scale; V's scale is linear in the output.
        scales = dict(k_scale=None if k_scale == 1.0 else k_scale)
        out = torch.empty(
            (q.shape[0], self.num_heads, self.kv_head_dim), dtype=q.dtype, device=q.device
        )
        nd = self._num_decode
        if self._xqa is not None:
            table, lens = self._xqa
            self._xqa_decode(
                q[:nd].contiguous(), kv_cache, table, lens, out[:nd], self.sm_scale * k_scale
            )
        elif self._decode is not None:
            self._decode.run(q[:nd], kv_cache, out=out[:nd], **scales)
        if self._prefill is not None:
            self._prefill.run(q[nd:], kv_cache, out=out[nd:], **scales)
        if v_scale != 1.0:
            out.mul_(v_scale)
        return out[..., : self.head_dim] if pad else out

    def _xqa_decode(self, q, kv_cache, table, lens, out, bmm1_scale: float) -> None:
        """XQA over the decode rows: q [nd, hq, d] contiguous, out [nd, hq, d]; V's scale is
        applied by the caller with the other rows'."""
        self._xqa_run(
            q,
            kv_cache,
            self._xqa_workspace,
            table,
            lens,
            table.shape[1] * kv_cache[0].shape[1],
            bmm1_scale=bmm1_scale,
            bmm2_scale=1.0,
            out=out,
            kv_layout="NHD",
        )
