"""ModelRunner: executes step plans. Owns the model, the KV pool, the attention backend, the
per-slot row state (`radixrt.executor.slots`: block tables, sampling parameters, last sampled
tokens on the device), the runner halves of features (`radixrt.executor.runner_features`):
per-slot penalty counts (`radixrt.executor.penalties`) and, with speculative_method 'draft', the
draft model and its KV pool (`radixrt.executor.draft`), and the row sampler that samples the
step's rows and verifies drafts (`radixrt.executor.row_sampling`).

`execute(plan)` applies the plan's slot entries, block-table changes and block ops, runs one
forward over all rows (or replays a decode CUDA graph, see `radixrt.executor.cuda_graph`),
samples, keeps each row's sample on the device for the next step and starts one non-blocking
copy of the results to the host; it returns at once with a handle (on a CPU the work is
already done). It never imports the scheduler: a plan is plain data.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixrt.attention import create_attention_backend
from radixrt.attention.forward_batch import ForwardBatch
from radixrt.cache.storage import (
    StorageIdentity,
    StorageIOStats,
    StorageOp,
    StorageResult,
)
from radixrt.cache.storage_backends import open_backend
from radixrt.config import EngineConfig, ModelConfig
from radixrt.executor.cpu_malloc import HeapTrim
from radixrt.executor.cuda_graph import DECODE_BUCKETS, DecodeCudaGraphs
from radixrt.executor.inputs import StepLayout, layout_plan
from radixrt.executor.penalties import SlotPenalties
from radixrt.executor.result import PendingResult
from radixrt.executor.row_sampling import RowSampler
from radixrt.executor.runner_features import RunnerFeature, StepContext
from radixrt.executor.slots import SlotState
from radixrt.executor.storage_io import StorageIO, weights_revision
from radixrt.kernels.native import CPU_LIBRARIES, prebuild
from radixrt.kv.host_pool import HostKVPool, blocks_touched, num_host_blocks
from radixrt.kv.pool import KVPool, kv_storage_dtype, num_blocks_for_memory
from radixrt.kv.scales import KVScales
from radixrt.model import DTYPES, build_model, weight_bytes
from radixrt.plan import CopyBlock, SlotEntry, StepHandle, StepPlan, SwapIn, SwapOut, SwapStats
from radixrt.quantization import resolve_scheme

if TYPE_CHECKING:
    from radixrt.lora.slots import LoraSlots
    from radixrt.model.tp.group import TPGroup

logger = logging.getLogger(__name__)


class ModelRunner:
    """See the module docstring. On CUDA with a backend that supports it (flashinfer) and
    `enable_cuda_graph`, decode-only steps replay CUDA graphs; the pool's last block is then
    the graphs' scratch block, so the allocator must manage only `num_usable_blocks`.

    With `tp` (tensor parallelism) it is one rank's runner: the model and the KV pool hold
    this rank's shard (its heads), the pool has as many blocks on every rank (the smallest
    count any rank can hold), and sampling draws from a generator seeded alike on every
    rank, so all ranks sample the same tokens from the same (all-gathered) logits. Every
    rank executes every plan; only rank 0 copies results to the host."""

    def __init__(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig,
        max_model_len: int,
        num_slots: int,
        tp: TPGroup | None = None,
    ) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.block_size = cfg.cache.block_size
        self.num_slots = num_slots
        self.tp = tp
        self._is_cuda = self.device.type == "cuda"
        self._copy_to_host = self._is_cuda and (tp is None or tp.rank == 0)
        start = time.perf_counter()
        self._setup_cpu()
        attn_cfg = self._load_model(max_model_len)
        self._build_lora_slots()
        self._build_attention(attn_cfg)
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        # Row state per slot (block tables, sampling parameters, last samples on the device).
        self.slots = SlotState(num_slots, self.max_blocks_per_seq, self.block_size, self.device)
        self.block_tables = self.slots.block_tables  # (the same array, for tests)
        self.last_tokens = self.slots.last_tokens
        self._build_features(max_model_len)
        self._allocate_kv_pool()
        self._prepare_cuda_graphs()
        scratch = None if self.cuda_graphs is None else self.pool.num_blocks - 1
        for f in self.features:
            f.on_pool(self.pool.num_blocks, self.block_size, scratch)
        # Blocks the allocator may hand out: all but the graphs' scratch block.
        self.num_usable_blocks = self.pool.num_blocks - (0 if self.cuda_graphs is None else 1)
        self._allocate_host_pool()
        logger.info("model runner ready in %.1f s", time.perf_counter() - start)

    # ---- build steps (in the order __init__ runs them) ----
    def _setup_cpu(self) -> None:
        # CPU: freed activations stay in the heap, up to a bound (cpu_malloc.HeapTrim)
        self.heap_trim = HeapTrim() if self.device.type == "cpu" else None
        if self.device.type != "cpu":
            return
        if self.cfg.cpu_threads is not None:
            torch.set_num_threads(self.cfg.cpu_threads)
            logger.info("CPU: %d torch threads", self.cfg.cpu_threads)
        prebuild(CPU_LIBRARIES)  # the native kernels, compiled at once on a first start

    def _load_model(self, max_model_len: int) -> ModelConfig:
        """Build the model (this rank's shard under TP); returns the config attention sees."""
        cfg, model_cfg, tp = self.cfg, self.model_cfg, self.tp
        shard = None
        attn_cfg = model_cfg
        if tp is not None:
            from radixrt.tp_shard import TPShard

            shard = TPShard.of(model_cfg, tp.rank, tp.size)
            # Attention on a rank is attention over its heads.
            attn_cfg = dataclasses.replace(
                model_cfg, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads
            )
        self.model = build_model(
            model_cfg,
            cfg.model_path,
            device=cfg.device,
            dtype=cfg.dtype,
            load_format=cfg.load_format,
            max_positions=max_model_len,
            seed=cfg.seed,
            shard=shard,
            group=tp,
            prepack=cfg.cpu_prepack_weights,
            fp8=resolve_scheme(
                model_cfg.checkpoint_fp8, cfg.quantization, cfg.fp8_activation_scale
            ),
            attention_backend=cfg.attention_backend,
        )
        logger.info(
            "weights: %.2f GiB%s",
            weight_bytes(self.model) / 2**30,
            f" ({self.model.fp8.describe()})" if self.model.fp8 is not None else "",
        )
        self.num_kv_heads = model_cfg.num_kv_heads if shard is None else shard.num_kv_heads
        return attn_cfg

    def _build_lora_slots(self) -> None:
        """The LoRA adapters' device slots (radixrt.lora.slots), before the KV pool is sized."""
        lora = self.cfg.lora
        self.lora: LoraSlots | None = None
        if not lora.enabled:
            return
        if self.model.fp8 is not None:
            raise ValueError(
                f"LoRA adapters (max_loras={lora.max_loras}) over an fp8 base "
                f"({self.model.fp8.describe()}) are not served: fused fp8 GEMMs take no LoRA "
                "delta yet"
            )
        from radixrt.lora.slots import LoraSlots

        self.lora = LoraSlots(
            self.model_cfg,
            lora.max_loras,
            lora.max_lora_rank,
            lora.host_capacity,
            self.device,
            self.dtype,
            shard=self.model.shard,
        )

    def _build_attention(self, attn_cfg: ModelConfig) -> None:
        cfg = self.cfg
        self.kv_dtype = kv_storage_dtype(cfg.cache.kv_cache_dtype, self.dtype)
        self.backend = create_attention_backend(
            cfg.attention_backend,
            attn_cfg,
            self.device,
            self.dtype,
            self.kv_dtype,
            decode_kernel=cfg.decode_attention_kernel,
        )
        # FlashInfer pads small heads; the pool stores what the backend attends over.
        self.kv_head_dim: int = self.backend.kv_head_dim

    def _build_features(self, max_model_len: int) -> None:
        """The runner halves of features, in hook order (the rules between them: see
        radixrt.executor.runner_features), and the row sampler over them. Their device memory
        is allocated here, before the KV pool is sized from what is left."""
        cfg, model_cfg, num_slots = self.cfg, self.model_cfg, self.num_slots
        # Tensor parallelism: the sampling noise of every rank from one seed (tp=1 keeps
        # torch's default generator).
        generator: torch.Generator | None = None
        if self.tp is not None:
            generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.penalties = SlotPenalties(num_slots, model_cfg.vocab_size, self.device)
        self.features: list[RunnerFeature] = []
        self.draft = None  # the draft model (speculative_method 'draft'), for inspection
        if cfg.speculative.speculative_method == "draft":
            from radixrt.executor.draft import DraftRunner

            self.draft = DraftRunner(cfg, model_cfg, max_model_len, self.slots, generator)
            self.features.append(self.draft)
        self.features.append(self.penalties)
        logger.info(
            "penalty counts: %.1f MiB (%d slots x %d tokens)",
            SlotPenalties.bytes_needed(num_slots, model_cfg.vocab_size) / 2**20,
            num_slots,
            model_cfg.vocab_size,
        )
        # Sampling of the step's rows (`radixrt.executor.row_sampling`): logits hooks, masks,
        # sampling, draft verification, last samples into the slots.
        self.sampler = RowSampler(
            self.device, self.slots, self.features, model_cfg.eos_token_ids, generator
        )

    def _allocate_kv_pool(self) -> None:
        num_blocks = self._num_kv_blocks()
        if self.tp is not None:
            num_blocks = self.tp.min_int(num_blocks)
        self.pool = KVPool(
            self.model_cfg.num_layers,
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.kv_head_dim,
            self.kv_dtype,
            self.device,
            scales=self._kv_scales() if self.cfg.cache.kv_fp8 else None,
        )
        logger.info(
            "KV pool: %s, %d blocks of %d tokens = %d tokens (%.2f GiB)%s",
            self.pool.kv_cache_dtype,
            num_blocks,
            self.block_size,
            self.pool.num_tokens,
            self.pool.kv.numel() * self.pool.kv.element_size() / 2**30,
            f", {self.pool.scales.describe()}" if self.pool.is_fp8 else "",
        )

    def _prepare_cuda_graphs(self) -> None:
        """Decode CUDA graphs (captured per bucket here; with LoRA a second graph per bucket
        takes the step's adapters); the pool's last block is their scratch block."""
        cfg = self.cfg
        # Recorded once a step's inputs are on the device: pinned staging buffers (ours and
        # FlashInfer's plan buffers) are rewritten only after it (overlap safety).
        self._inputs_on_device: torch.cuda.Event | None = None
        self.cuda_graphs: DecodeCudaGraphs | None = None
        if cfg.enable_cuda_graph and self._is_cuda:
            if self.backend.supports_cuda_graph:
                self.cuda_graphs = DecodeCudaGraphs(
                    self._decode_logits,
                    self.backend,
                    max_batch_size=min(
                        self.num_slots * graph_tokens_per_row(cfg), DECODE_BUCKETS[-1]
                    ),
                    max_blocks_per_seq=self.max_blocks_per_seq,
                    block_size=self.block_size,
                    scratch_block=self.pool.num_blocks - 1,
                    device=self.device,
                    lora=self.lora,
                )
            else:
                logger.info(
                    "CUDA graphs off: the %s backend does not support them", cfg.attention_backend
                )
        self.max_graph_tokens = 0 if self.cuda_graphs is None else self.cuda_graphs.max_batch_size

    def _allocate_host_pool(self) -> None:
        """The host KV tier (radixrt.kv.host_pool), sized here; the cache's allocator matches."""
        self.host_pool: HostKVPool | None = None
        self.num_host_blocks = 0
        if self.cfg.cache.host_tier:
            per_block = self.pool.kv[:, :, 0].numel() * self.pool.kv.element_size()
            self.num_host_blocks = num_host_blocks(
                self.cfg.cache.host_kv_gb, self.cfg.cache.num_host_kv_blocks, per_block
            )
            self.host_pool = HostKVPool(self.num_host_blocks, self.pool)
        self.storage: StorageIO | None = None
        self.storage_identity: StorageIdentity | None = None
        if self.cfg.cache.kv_storage is not None:
            self._open_storage()

    def _open_storage(self) -> None:
        """The storage tier's backend and I/O thread (radixrt.executor.storage_io)."""
        c, pool = self.cfg.cache, self.pool
        backend = open_backend(
            c.kv_storage, self.host_pool.bytes_per_block, int(c.kv_storage_max_gb * 2**30)
        )
        self.storage = StorageIO(backend, self.host_pool, c.kv_storage_write_pages)
        self.storage_identity = StorageIdentity(
            model=os.path.realpath(self.cfg.model_path),
            revision=weights_revision(self.cfg.model_path, self.cfg.load_format, self.cfg.seed),
            kv_dtype=pool.kv_cache_dtype,
            kv_scales=pool.scales.describe() if pool.is_fp8 else "",
            layout=f"page-first {list(self.host_pool.kv.shape[1:])}",
            tp_rank=0 if self.tp is None else self.tp.rank,
            tp_size=1 if self.tp is None else self.tp.size,
        )

    def storage_io(self, ops: list[StorageOp]) -> list[StorageResult]:
        """Start the storage tier's ops; what finished since the last call, in order."""
        assert self.storage is not None, "storage ops without a storage tier"
        return self.storage.exchange(ops)

    def storage_wait(self, timeout_s: float) -> None:
        """Block until a storage fetch finishes, at most `timeout_s`."""
        assert self.storage is not None, "a storage wait without a storage tier"
        self.storage.wait_for_fetch(timeout_s)

    def storage_stats(self) -> StorageIOStats:
        """The storage tier's runner-side counters (all zero without one)."""
        return self.storage.stats() if self.storage is not None else StorageIOStats()

    def _kv_scales(self) -> KVScales:
        """An fp8 pool's scales: the checkpoint's kv scales, else 1.0 for every layer."""
        num_layers = self.model_cfg.num_layers
        if self.cfg.load_format != "dummy":
            from radixrt.model.kv_scales import load_kv_scales

            found = load_kv_scales(self.cfg.model_path, num_layers)
            if found is not None:
                return found
        return KVScales.ones(num_layers)

    def _num_kv_blocks(self) -> int:
        """Pool size: explicit, `cpu_kv_blocks` on a CPU, else what fits in the device's
        memory budget (in bytes: an fp8 pool gets twice the blocks of a bf16 one)."""
        c, m = self.cfg.cache, self.model_cfg
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if self.device.type != "cuda":
            return c.cpu_kv_blocks
        per_block = KVPool.bytes_per_block(
            m.num_layers, c.block_size, self.num_kv_heads, self.kv_head_dim, self.kv_dtype
        )
        per_block += sum(f.kv_bytes_per_block(c.block_size) for f in self.features)
        free, total = torch.cuda.mem_get_info(self.device)
        num = num_blocks_for_memory(free, total, c.mem_fraction, per_block)
        if num < 2:
            raise ValueError(
                f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free after "
                f"loading the model; raise mem_fraction or set num_kv_blocks"
            )
        return num

    def swap_stats(self) -> SwapStats:
        """The host pool's transfer totals (all zero without a host tier)."""
        return self.host_pool.stats() if self.host_pool is not None else SwapStats()

    def check_health(self) -> None:
        """A single-process runner stays usable (a CUDA error surfaces from `execute`)."""

    def close(self) -> None:
        """Finish the storage tier's queued writes; the rest the garbage collector frees."""
        if getattr(self, "storage", None) is not None:
            self.storage.close()

    # ---- the step ----
    @torch.inference_mode()
    def execute(self, plan: StepPlan, *, use_cuda_graph: bool = True) -> StepHandle:
        """Run `plan` (see the module docstring). `use_cuda_graph=False` forces the eager
        path (benchmarks, tests)."""
        ctx = StepContext(plan, self._begin(plan), use_cuda_graph)
        for f in self.features:
            f.before_forward(ctx)
        logits, scores = self._forward(ctx)
        outputs = self.sampler.sample(ctx, logits)
        outputs.prompt_logprobs = scores
        if self.heap_trim is not None:
            self.heap_trim.after_step()
        return PendingResult(plan, ctx.layout, outputs, copy_to_host=self._copy_to_host)

    def _begin(self, plan: StepPlan) -> StepLayout:
        """Wait until the previous step's inputs left the staging buffers, apply slot entries
        and block-table changes, run block ops; returns the step's host layout."""
        if self._inputs_on_device is not None:
            self._inputs_on_device.synchronize()
        if plan.new_slots:
            self.enter_slots(plan.new_slots)
        self.slots.apply_table_deltas(plan)
        copies = [op for op in plan.block_ops if isinstance(op, CopyBlock)]
        if self.host_pool is not None:
            self._swap(plan, copies)
        elif len(copies) < len(plan.block_ops):
            raise ValueError("swap ops need a host KV tier (host_kv_gb), which is not configured")
        for op in copies:
            self.pool.copy_prefix(op.src, op.dst, op.num_tokens)
            for f in self.features:
                f.on_block_copy(op)
        return layout_plan(plan, self.slots.params)

    def enter_slots(self, entries: list[SlotEntry]) -> None:
        """Apply slot entries (what `execute` does first with a plan's `new_slots`; public
        for benchmarks that reuse one hand-made plan)."""
        self.slots.enter(entries)
        for f in self.features:
            f.on_slots(entries)

    def _swap(self, plan: StepPlan, copies: list[CopyBlock]) -> None:
        """Host tier: wait for the previous step's transfers, start this step's (they come
        first in the plan and never touch a copy's blocks; see radixrt.kv.host_pool)."""
        pool = self.host_pool
        if self._is_cuda:
            pool.wait_previous()
        swaps = [op for op in plan.block_ops if isinstance(op, SwapIn | SwapOut)]
        if swaps:
            read, written = blocks_touched(plan.rows, self.block_tables, self.block_size)
            read.update(op.src for op in copies)
            written.update(op.dst for op in copies)
            pool.execute(swaps, read, written)

    def _inputs_staged(self) -> None:
        if self._is_cuda:
            if self._inputs_on_device is None:
                self._inputs_on_device = torch.cuda.Event()
            self._inputs_on_device.record()

    def _forward(self, ctx: StepContext) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits of the sampled tokens [S, vocab] float32 (None if S = 0) and the log-probs
        of the scored prompt tokens [P] float32 (None if P = 0). `ctx.input_writes` (a
        feature's device ids, e.g. the draft model's drafts) overwrite those inputs; the
        features' `after_forward` hooks run after the target's forward."""
        plan, layout = ctx.plan, ctx.layout
        graphs = self.cuda_graphs
        token_slot = None  # each token's LoRA slot (None: every row is the base model's)
        if self.lora is not None:
            loras = self.slots.loras
            token_slot = self.lora.token_slots([loras[s] for s in layout.slots], layout.num_new)
        graphed = (
            ctx.use_cuda_graph and graphs is not None and (token_slot is None or graphs.covers_lora)
        )
        if graphed and graphs.can_run(plan, layout):
            tables = self.block_tables[layout.slots]
            logits = graphs.run(
                layout,
                tables,
                self.last_tokens,
                self._inputs_staged,
                device_inputs=ctx.input_writes,
                lora_token_slot=token_slot,
            )
            for f in self.features:
                f.after_forward(ctx, None)
            return logits, None
        fb = self.build_batch(layout)
        fb.lora = None if token_slot is None else self.lora.batch(token_slot)
        if ctx.input_writes is not None:
            index, ids = ctx.input_writes
            fb.input_ids[index] = ids
        self.backend.prepare(fb)
        self._inputs_staged()
        hidden = self.model(fb, self.backend, self.pool)
        for f in self.features:
            f.after_forward(ctx, fb)
        dev = self.device
        num_s, num_p = len(layout.sample_tokens), len(layout.score_tokens)
        if num_s + num_p == 0:
            return None, None
        if num_p == 0 and num_s == hidden.shape[0]:
            # every token sampled (sample_tokens ascend, so they are 0..T-1): no gather
            logits = self.model.compute_logits(hidden)
        else:
            index = np.concatenate([layout.sample_tokens, layout.score_tokens])
            logits = self.model.compute_logits(
                hidden[torch.from_numpy(index).to(dev, non_blocking=True)]
            )
        scores = None
        if num_p:
            targets = torch.from_numpy(layout.score_targets).to(dev, non_blocking=True).unsqueeze(1)
            lps = torch.log_softmax(logits[num_s:], dim=-1)
            scores = lps.gather(1, targets).squeeze(1)
        return (logits[:num_s] if num_s else None), scores

    def build_batch(self, layout: StepLayout) -> ForwardBatch:
        """The step's ForwardBatch (`SlotState.forward_batch`)."""
        return self.slots.forward_batch(layout)

    def _decode_logits(self, fb: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """What a decode CUDA graph captures: forward + logits of every row (into `out`
        [rows, vocab] float32 when given)."""
        return self.model.compute_logits(self.model(fb, self.backend, self.pool), out)

    # ---- for tests and benchmarks ----
    @torch.inference_mode()
    def logits(self, plan: StepPlan, *, use_cuda_graph: bool = True) -> torch.Tensor | None:
        """Forward `plan` and return the logits of its samples [S, vocab] (no sampling, no
        row state kept). Block-table changes and block ops are applied."""
        return self._forward(StepContext(plan, self._begin(plan), use_cuda_graph))[0]


def graph_tokens_per_row(cfg: EngineConfig) -> int:
    """Tokens per row the decode graphs are sized for: 1 + k with speculation (verify rows),
    else 1 (graph buckets cover max_running_requests rows of that many tokens)."""
    drafting = cfg.speculative.speculative_method != "none"
    return 1 + (cfg.scheduler.num_speculative_tokens if drafting else 0)
