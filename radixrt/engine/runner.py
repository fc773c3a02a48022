"""ModelRunner: executes step plans. Owns the model, the KV pool, the attention backend and the
per-slot row state (block tables, last sampled tokens on the device).

`execute(plan)` applies the plan's block-table changes and block ops, runs one forward over all
rows (or replays a decode CUDA graph, see `radixrt.engine.cuda_graph`), samples, keeps each
row's sample on the device for the next step and starts one non-blocking copy of the results to
the host; it returns at once with a handle (on a CPU the work is already done). It never
imports the scheduler: a plan is plain data.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixrt.attention import create_attention_backend
from radixrt.attention.forward_batch import ForwardBatch
from radixrt.config import EngineConfig, ModelConfig
from radixrt.engine.cuda_graph import DECODE_BUCKETS, DecodeCudaGraphs
from radixrt.engine.inputs import StepLayout, layout_plan
from radixrt.engine.result import PendingResult, StepOutputs
from radixrt.engine.sampler import apply_logit_bias, apply_penalties, sample
from radixrt.kv.host_pool import HostKVPool, blocks_touched, num_host_blocks
from radixrt.kv.pool import KVPool
from radixrt.model import DTYPES, build_model
from radixrt.plan import CopyBlock, StepHandle, StepPlan, SwapIn, SwapOut

if TYPE_CHECKING:
    from radixrt.distributed.group import TPGroup

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
        if self.device.type == "cpu" and cfg.cpu_threads is not None:
            torch.set_num_threads(cfg.cpu_threads)
            logger.info("CPU: %d torch threads", cfg.cpu_threads)
        self.tp = tp
        start = time.perf_counter()
        shard = attn_cfg = None
        if tp is not None:
            from radixrt.distributed.shard import TPShard

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
        )
        self.num_kv_heads = model_cfg.num_kv_heads if shard is None else shard.num_kv_heads
        self.backend = create_attention_backend(
            cfg.attention_backend, attn_cfg or model_cfg, self.device, self.dtype
        )
        # FlashInfer pads small heads; the pool stores what the backend attends over.
        self.kv_head_dim: int = getattr(self.backend, "kv_head_dim", model_cfg.head_dim)
        num_blocks = self._num_kv_blocks()
        if tp is not None:
            num_blocks = tp.min_int(num_blocks)
        self.pool = KVPool(
            model_cfg.num_layers,
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.kv_head_dim,
            self.dtype,
            self.device,
        )
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        # Row state per slot: the block table (host copy, updated from plans) and the
        # token the row sampled last (device: the next decode step reads it there).
        self.block_tables = np.zeros((num_slots, self.max_blocks_per_seq), dtype=np.int32)
        self.last_tokens = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        self._is_cuda = self.device.type == "cuda"
        self._copy_to_host = self._is_cuda and (tp is None or tp.rank == 0)
        # Tensor parallelism: the sampling noise of every rank from one seed (tp=1 keeps
        # torch's default generator).
        self._generator: torch.Generator | None = None
        if tp is not None:
            self._generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        # Recorded once a step's inputs are on the device: pinned staging buffers (ours and
        # FlashInfer's plan buffers) are rewritten only after it (overlap safety).
        self._inputs_on_device: torch.cuda.Event | None = None
        self.cuda_graphs: DecodeCudaGraphs | None = None
        if cfg.enable_cuda_graph and self._is_cuda:
            if getattr(self.backend, "supports_cuda_graph", False):
                self.cuda_graphs = DecodeCudaGraphs(
                    self._decode_logits,
                    self.backend,
                    max_batch_size=min(num_slots, DECODE_BUCKETS[-1]),
                    max_blocks_per_seq=self.max_blocks_per_seq,
                    block_size=self.block_size,
                    scratch_block=self.pool.num_blocks - 1,
                    device=self.device,
                )
            else:
                logger.info(
                    "CUDA graphs off: the %s backend does not support them", cfg.attention_backend
                )
        # Blocks the allocator may hand out: all but the graphs' scratch block.
        self.num_usable_blocks = self.pool.num_blocks - (0 if self.cuda_graphs is None else 1)
        # Host KV tier (see radixrt.kv.host_pool): sized here, the cache's allocator matches.
        self.host_pool: HostKVPool | None = None
        self.num_host_blocks = 0
        if cfg.cache.host_tier:
            per_block = self.pool.kv[:, :, 0].numel() * self.pool.kv.element_size()
            self.num_host_blocks = num_host_blocks(
                cfg.cache.host_kv_gb, cfg.cache.num_host_kv_blocks, per_block
            )
            self.host_pool = HostKVPool(self.num_host_blocks, self.pool)
        logger.info("model runner ready in %.1f s", time.perf_counter() - start)

    def _num_kv_blocks(self) -> int:
        c, m = self.cfg.cache, self.model_cfg
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if self.device.type != "cuda":
            return c.cpu_kv_blocks
        per_block = KVPool.bytes_per_block(
            m.num_layers, c.block_size, self.num_kv_heads, self.kv_head_dim, self.dtype
        )
        free, total = torch.cuda.mem_get_info(self.device)
        # Leave (1 - mem_fraction) of the whole device for activations, graphs, workspace.
        budget = free - (1.0 - c.mem_fraction) * total
        num = int(budget // per_block)
        if num < 2:
            raise ValueError(
                f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free after "
                f"loading the model; raise mem_fraction or set num_kv_blocks"
            )
        logger.info(
            "KV pool: %d blocks of %d tokens (%.1f GiB)", num, c.block_size, num * per_block / 2**30
        )
        return num

    # ---- the step ----
    @torch.inference_mode()
    def execute(self, plan: StepPlan, *, use_cuda_graph: bool = True) -> StepHandle:
        """Run `plan` (see the module docstring). `use_cuda_graph=False` forces the eager
        path (benchmarks, tests)."""
        layout = self._begin(plan)
        logits, scores = self._forward(plan, layout, use_cuda_graph)
        outputs = self._sample(plan, layout, logits)
        outputs.prompt_logprobs = scores
        return PendingResult(plan, layout, outputs, copy_to_host=self._copy_to_host)

    def _begin(self, plan: StepPlan) -> StepLayout:
        """Wait until the previous step's inputs left the staging buffers, apply block-table
        changes, run block ops; returns the step's host layout."""
        if self._inputs_on_device is not None:
            self._inputs_on_device.synchronize()
        for r in plan.rows:
            if r.new_blocks:
                self.block_tables[r.slot, r.table_start : r.table_start + len(r.new_blocks)] = (
                    r.new_blocks
                )
        copies = [op for op in plan.block_ops if isinstance(op, CopyBlock)]
        if self.host_pool is not None:
            self._swap(plan, copies)
        elif len(copies) < len(plan.block_ops):
            raise ValueError("swap ops need a host KV tier (host_kv_gb), which is not configured")
        for op in copies:
            self.pool.copy_prefix(op.src, op.dst, op.num_tokens)
        return layout_plan(plan)

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

    def _forward(
        self, plan: StepPlan, layout: StepLayout, use_cuda_graph: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits of the sampled tokens [S, vocab] float32 (None if S = 0) and the log-probs
        of the scored prompt tokens [P] float32 (None if P = 0)."""
        graphs = self.cuda_graphs
        if use_cuda_graph and graphs is not None and graphs.can_run(plan, layout):
            tables = self.block_tables[layout.slots]
            logits = graphs.run(
                layout, tables, self.last_tokens, on_inputs_staged=self._inputs_staged
            )
            return logits, None
        fb = self.build_batch(layout)
        self.backend.prepare(fb)
        self._inputs_staged()
        hidden = self.model(fb, self.backend, self.pool)
        dev = self.device
        num_s, num_p = len(layout.sample_tokens), len(layout.score_tokens)
        if num_s + num_p == 0:
            return None, None
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
        """The step's ForwardBatch: inputs copied to the device, device-resident last samples
        gathered in, attention metadata built from the slots' block tables."""
        bs, dev = self.block_size, self.device
        seq_lens = layout.starts + layout.num_new
        nblocks = (seq_lens + bs - 1) // bs
        kv_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
        np.cumsum(nblocks, out=kv_indptr[1:])
        tables = self.block_tables[layout.slots, : int(nblocks.max())]
        to_dev = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
        tables_d, seq_lens_d, start_d, new_d, qo_d = map(
            to_dev, (tables, seq_lens, layout.starts, layout.num_new, layout.qo_indptr)
        )
        input_ids = to_dev(layout.host_ids)
        if len(layout.last_read_tokens):
            input_ids[to_dev(layout.last_read_tokens)] = self.last_tokens[
                to_dev(layout.last_read_slots)
            ]
        if self._is_cuda:
            from radixrt.kernels import build_kv_metadata, build_token_metadata
        else:
            from radixrt.kernels import build_kv_metadata_reference as build_kv_metadata
            from radixrt.kernels import build_token_metadata_reference as build_token_metadata
        kv = build_kv_metadata(tables_d, seq_lens_d, bs, int(kv_indptr[-1]))
        tok = build_token_metadata(tables_d, start_d, new_d, qo_d, layout.num_tokens, bs)
        return ForwardBatch(
            input_ids=input_ids,
            positions=tok.positions,
            slot_mapping=tok.slot_mapping,
            qo_indptr=qo_d,
            kv_indptr=kv.kv_indptr,
            kv_indices=kv.kv_indices,
            kv_last_page_len=kv.kv_last_page_len,
            seq_lens=seq_lens_d,
            logits_indices=to_dev(layout.sample_tokens),
            num_decode=layout.num_decode,
            qo_indptr_cpu=torch.from_numpy(layout.qo_indptr),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            kv_indptr_cpu=torch.from_numpy(kv_indptr),
            block_size=bs,
        )

    def _decode_logits(self, fb: ForwardBatch) -> torch.Tensor:
        """What a decode CUDA graph captures: forward + logits of every row."""
        return self.model.compute_logits(self.model(fb, self.backend, self.pool))

    def _sample(
        self, plan: StepPlan, layout: StepLayout, logits: torch.Tensor | None
    ) -> StepOutputs:
        """Sample every listed position, verify drafts, keep each row's last accepted
        sample in its slot on the device."""
        out = StepOutputs()
        if logits is None:
            return out
        params = layout.sample_params
        if any(p.has_penalties for p in params):
            rows = [plan.rows[i] for i in layout.sample_rows.tolist()]
            apply_penalties(
                logits,
                params,
                [r.history[: r.prompt_len] if r.history else [] for r in rows],
                [r.history[r.prompt_len :] if r.history else [] for r in rows],
            )
        if any(p.logit_bias for p in params):
            apply_logit_bias(logits, params)  # log-probs are of the distribution sampled from
        want_logprobs = any(p.logprobs for p in params)
        top_k = max(p.top_logprobs for p in params)
        sampled = sample(
            logits, params, layout.seed_offsets, want_logprobs, top_k, generator=self._generator
        )
        tokens = sampled.token_ids
        out.tokens, out.logprobs = tokens, sampled.logprobs
        out.top_ids, out.top_logprobs = sampled.top_ids, sampled.top_logprobs
        dev = self.device
        last = layout.row_first_sample + layout.num_samples - 1  # [R]: the row's last sample
        drafting = [i for i, r in enumerate(plan.rows) if r.num_draft_tokens]
        if drafting:
            out.num_accepted = self._verify(plan, layout, tokens, drafting)
        keep = [
            i for i, r in enumerate(plan.rows) if layout.num_samples[i] and not r.num_draft_tokens
        ]
        if keep:
            slots = torch.from_numpy(layout.slots[keep]).to(dev, non_blocking=True)
            src = torch.from_numpy(last[keep]).to(dev, non_blocking=True)
            self.last_tokens.index_copy_(0, slots, tokens[src])
        return out

    def _verify(
        self, plan: StepPlan, layout: StepLayout, tokens: torch.Tensor, rows: list[int]
    ) -> torch.Tensor:
        """Accepted drafts per drafting row [len(rows)] int64 (device): the longest prefix of
        its drafts equal to the samples at the positions before them. A sample made with the
        row's own sampling parameters that equals a deterministic draft accepts it, so the
        output has exactly the distribution of non-speculative sampling."""
        k = max(plan.rows[i].num_draft_tokens for i in rows)
        drafts = np.zeros((len(rows), k), dtype=np.int64)
        index = np.zeros((len(rows), k), dtype=np.int64)
        valid = np.zeros((len(rows), k), dtype=bool)
        for j, i in enumerate(rows):
            r = plan.rows[i]
            n = r.num_draft_tokens
            assert layout.num_samples[i] == n + 1, "a drafting row samples at its k + 1 last tokens"
            drafts[j, :n] = r.input_ids[len(r.input_ids) - n :]
            index[j, :n] = layout.row_first_sample[i] + np.arange(n)
            valid[j, :n] = True
        dev = self.device
        to_dev = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
        match = (tokens[to_dev(index)] == to_dev(drafts)) & to_dev(valid)
        return match.to(torch.int64).cumprod(dim=1).sum(dim=1)

    # ---- for tests and benchmarks ----
    @torch.inference_mode()
    def logits(self, plan: StepPlan, *, use_cuda_graph: bool = True) -> torch.Tensor | None:
        """Forward `plan` and return the logits of its samples [S, vocab] (no sampling, no
        row state kept). Block-table changes and block ops are applied."""
        layout = self._begin(plan)
        return self._forward(plan, layout, use_cuda_graph)[0]
