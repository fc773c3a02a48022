"""ModelRunner: owns the model, the KV pool and the attention backend; turns a
ScheduledBatch into a ForwardBatch, runs the forward (or replays a decode CUDA graph,
see `radixrt.engine.cuda_graph`) and samples."""

from __future__ import annotations

import logging
import math
import time
from typing import NamedTuple

import numpy as np
import torch

from radixrt.attention import create_attention_backend
from radixrt.attention.forward_batch import ForwardBatch
from radixrt.config import EngineConfig, ModelConfig
from radixrt.engine.cuda_graph import DECODE_BUCKETS, DecodeCudaGraphs
from radixrt.engine.sampler import apply_penalties, sample
from radixrt.kv.pool import KVPool
from radixrt.model import DTYPES, build_model
from radixrt.scheduler.batch import BlockTableArray, ScheduledBatch, StepOutput

logger = logging.getLogger(__name__)


class ModelOutput(NamedTuple):
    logits: torch.Tensor | None  # [S, vocab] float32: rows that sample, in row order; None if S = 0
    samples: np.ndarray  # [R] bool: rows that sample this step
    prompt_logprobs: dict[int, list[float]]  # row -> log-probs of its prompt tokens this step


class ModelRunner:
    """Owns the model, the KV pool and the attention backend. On CUDA with a backend that
    supports it (flashinfer) and `enable_cuda_graph`, decode-only steps replay CUDA graphs;
    the pool's last block is then the graphs' scratch block, so the allocator must manage
    only `num_usable_blocks` blocks."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, max_model_len: int) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.block_size = cfg.cache.block_size
        start = time.perf_counter()
        self.model = build_model(
            model_cfg,
            cfg.model_path,
            device=cfg.device,
            dtype=cfg.dtype,
            load_format=cfg.load_format,
            max_positions=max_model_len,
            seed=cfg.seed,
        )
        self.backend = create_attention_backend(
            cfg.attention_backend, model_cfg, self.device, self.dtype
        )
        # FlashInfer pads small heads; the pool stores what the backend attends over.
        self.kv_head_dim: int = getattr(self.backend, "kv_head_dim", model_cfg.head_dim)
        self.pool = KVPool(
            model_cfg.num_layers,
            self._num_kv_blocks(),
            self.block_size,
            model_cfg.num_kv_heads,
            self.kv_head_dim,
            self.dtype,
            self.device,
        )
        self._use_kernels = self.device.type == "cuda"
        self.cuda_graphs: DecodeCudaGraphs | None = None
        if cfg.enable_cuda_graph and self.device.type == "cuda":
            if getattr(self.backend, "supports_cuda_graph", False):
                self.cuda_graphs = DecodeCudaGraphs(
                    self._decode_logits,
                    self.backend,
                    max_batch_size=min(cfg.scheduler.max_running_requests, DECODE_BUCKETS[-1]),
                    max_blocks_per_seq=math.ceil(max_model_len / self.block_size),
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
        logger.info("model runner ready in %.1f s", time.perf_counter() - start)

    def _num_kv_blocks(self) -> int:
        c, m = self.cfg.cache, self.model_cfg
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if self.device.type != "cuda":
            return c.cpu_kv_blocks
        per_block = KVPool.bytes_per_block(
            m.num_layers, c.block_size, m.num_kv_heads, self.kv_head_dim, self.dtype
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

    # ---- batch building ----
    def build_batch(
        self, batch: ScheduledBatch, tables: BlockTableArray
    ) -> tuple[ForwardBatch, np.ndarray]:
        """The step's ForwardBatch and which rows sample ([R] bool)."""
        rows, num_new = batch.rows, batch.num_new
        bs = self.block_size
        start = np.fromiter((r.num_computed for r in rows), dtype=np.int32, count=len(rows))
        new = np.asarray(num_new, dtype=np.int32)
        seq_lens = start + new
        qo_indptr = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(new, out=qo_indptr[1:])
        nblocks = (seq_lens + bs - 1) // bs
        kv_indptr = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(nblocks, out=kv_indptr[1:])
        ids: list[int] = [r.token_ids[-1] for r in rows[: batch.num_decode]]
        for r, s, n in zip(
            rows[batch.num_decode :], start[batch.num_decode :], new[batch.num_decode :]
        ):
            ids += r.token_ids[s : s + n]
        # Rows that reach the end of their tokens sample from their last new token.
        samples = np.array(
            [s + n == len(r.token_ids) for r, s, n in zip(rows, start, new)], dtype=bool
        )
        logits_indices = qo_indptr[1:][samples] - 1

        dev = self.device
        max_blocks = int(nblocks.max())
        block_tables = torch.from_numpy(tables.table[batch.table_rows, :max_blocks])
        to_dev = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
        block_tables_d = block_tables.to(dev, non_blocking=True)
        seq_lens_d, start_d, new_d, qo_d = map(to_dev, (seq_lens, start, new, qo_indptr))
        num_tokens = int(qo_indptr[-1])
        if self._use_kernels:
            from radixrt.kernels import build_kv_metadata, build_token_metadata
        else:
            from radixrt.kernels import build_kv_metadata_reference as build_kv_metadata
            from radixrt.kernels import build_token_metadata_reference as build_token_metadata
        kv = build_kv_metadata(block_tables_d, seq_lens_d, bs, int(kv_indptr[-1]))
        tok = build_token_metadata(block_tables_d, start_d, new_d, qo_d, num_tokens, bs)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=tok.positions,
            slot_mapping=tok.slot_mapping,
            qo_indptr=qo_d,
            kv_indptr=kv.kv_indptr,
            kv_indices=kv.kv_indices,
            kv_last_page_len=kv.kv_last_page_len,
            seq_lens=seq_lens_d,
            logits_indices=torch.from_numpy(logits_indices.astype(np.int64)).to(dev),
            num_decode=batch.num_decode,
            qo_indptr_cpu=torch.from_numpy(qo_indptr),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            kv_indptr_cpu=torch.from_numpy(kv_indptr),
            block_size=bs,
        ), samples

    # ---- forward ----
    @torch.inference_mode()
    def forward(
        self, batch: ScheduledBatch, tables: BlockTableArray, *, use_cuda_graph: bool = True
    ) -> StepOutput:
        """Run one step: forward every row's new tokens, sample the rows that reached
        the end of their tokens, and compute prompt log-probs where asked.
        `use_cuda_graph=False` forces the eager path (benchmarks, tests)."""
        out = self.run_model(batch, tables, use_cuda_graph=use_cuda_graph)
        tokens = [0] * len(batch.rows)
        if out.logits is None:
            return StepOutput(tokens, None, out.prompt_logprobs)
        sampling_rows = [r for r, s in zip(batch.rows, out.samples) if s]
        params = [r.params for r in sampling_rows]
        if any(p.has_penalties for p in params):  # slicing every row's tokens costs ~5 us
            apply_penalties(
                out.logits,
                params,
                [r.token_ids[: r.prompt_len] for r in sampling_rows],
                [r.output_ids for r in sampling_rows],
            )
        want_logprobs = any(p.logprobs for p in params)
        sampled_out = sample(
            out.logits, params, [r.num_output for r in sampling_rows], want_logprobs
        )
        sampled = sampled_out.token_ids.tolist()
        sampled_lp = sampled_out.logprobs.tolist() if sampled_out.logprobs is not None else None
        logprobs = [0.0] * len(batch.rows) if sampled_lp is not None else None
        for j, i in enumerate(np.flatnonzero(out.samples)):
            tokens[i] = sampled[j]
            if logprobs is not None:
                logprobs[i] = sampled_lp[j]
        return StepOutput(tokens, logprobs, out.prompt_logprobs)

    @torch.inference_mode()
    def run_model(
        self, batch: ScheduledBatch, tables: BlockTableArray, *, use_cuda_graph: bool = True
    ) -> ModelOutput:
        """Forward one step and return the logits of the rows that sample (no sampling).
        Decode-only batches replay a CUDA graph when graphs are on and `use_cuda_graph`."""
        graphs = self.cuda_graphs
        if (
            use_cuda_graph
            and graphs is not None
            and graphs.can_run(batch)
            and not any(r.params.prompt_logprobs for r in batch.rows)
        ):
            # Every decode row samples (it feeds its last token).
            logits = graphs.run(batch, tables)
            return ModelOutput(logits, np.ones(len(batch.rows), dtype=bool), {})
        fb, samples = self.build_batch(batch, tables)
        self.backend.prepare(fb)
        hidden = self.model(fb, self.backend, self.pool)
        prompt_lps = self._prompt_logprobs(batch, hidden)
        if not samples.any():
            return ModelOutput(None, samples, prompt_lps)
        logits = self.model.compute_logits(hidden[fb.logits_indices])
        return ModelOutput(logits, samples, prompt_lps)

    def _decode_logits(self, fb: ForwardBatch) -> torch.Tensor:
        """What a decode CUDA graph captures: forward + logits of every row."""
        return self.model.compute_logits(self.model(fb, self.backend, self.pool))

    def _prompt_logprobs(
        self, batch: ScheduledBatch, hidden: torch.Tensor
    ) -> dict[int, list[float]]:
        """log p(prompt token p+1 | ...) for each new token at position p with
        logprob_start_len - 1 <= p <= prompt_len - 2, per row that asked."""
        rows, index, targets = [], [], []
        offset = 0
        for i, (req, n) in enumerate(zip(batch.rows, batch.num_new)):
            if req.params.prompt_logprobs:
                lo = max(req.num_computed, req.params.logprob_start_len - 1)
                hi = min(req.num_computed + n, req.prompt_len - 1)
                if hi > lo:
                    rows.append((i, hi - lo))
                    index.extend(
                        range(offset + lo - req.num_computed, offset + hi - req.num_computed)
                    )
                    targets.extend(req.token_ids[lo + 1 : hi + 1])
            offset += n
        if not rows:
            return {}
        dev = hidden.device
        logits = self.model.compute_logits(hidden[torch.tensor(index, device=dev)])
        target = torch.tensor(targets, device=dev).unsqueeze(1)
        lps = torch.log_softmax(logits, dim=-1).gather(1, target).squeeze(1).tolist()
        out, k = {}, 0
        for i, count in rows:
            out[i] = lps[k : k + count]
            k += count
        return out
