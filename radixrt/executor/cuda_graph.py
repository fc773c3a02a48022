"""CUDA graphs for decode-only steps, one per batch-size bucket.

A decode step of R rows runs the graph of the smallest bucket >= R; rows [R, bucket) are
padding. Padding rows feed token 0 at position 0 and write their K/V into a scratch block
that the allocator never hands out (`scratch_block`, the pool's last block), and attend over
that block alone, so they never touch the KV of real requests. Each graph computes the
logits of every row (model forward + lm_head); sampling runs outside.

Short multi-token rows run in the same graphs: a row of n <= GRAPH_MAX_ROW_TOKENS new
tokens is fed as n decode rows over its block table, token j at position start + j attending
to KV [0, start + j] (every row's K/V is stored before attention in each layer), which is
exactly the row's causal mask (`decode_rows`). That covers speculative verify rows (the last
sample + k drafts) and jump-forward runs of forced tokens. Such a plan fits a bucket by its
token count; the graph computes the logits of every token and the step keeps its samples'.

Host-side inputs are built with numpy from the rows' block tables (no device kernels, no
sync), copied into static device buffers with one pinned copy (rows that read their last
sample on the device get it by one device gather), and the attention backend plans the
bucket's decode wrapper right before the replay.

With LoRA (`lora`), each bucket has a second graph that adds the rows' adapter deltas: the
segmented kernels over padded segments at fixed addresses (`StaticLoraSegments`), which a
step fills from its token -> slot map with one more pinned copy; padding rows are base rows.
Steps without adapted rows replay the first graph, which launches no LoRA kernel.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from radixrt.attention.forward_batch import ForwardBatch
from radixrt.executor.inputs import StepLayout
from radixrt.kernels.lora import StaticLoraSegments
from radixrt.plan import StepPlan

if TYPE_CHECKING:
    from radixrt.lora.slots import LoraSlots

logger = logging.getLogger(__name__)

# Spaced 8 rows apart up to 256, then 16 and 32 (a padding row costs less of a larger step):
# 67 graphs where max_running_requests reaches 1024, the 35 up to 256 otherwise.
DECODE_BUCKETS = (1, 2, 4, 8, *range(16, 257, 8), *range(272, 513, 16), *range(544, 1025, 32))
# Longest row a graph step takes (fed as that many decode rows; each reads the row's KV again,
# which the decode kernel serves from L2 for short rows): verify rows of k <= 15 drafts, short
# jump-forward runs. Longer rows (prefill chunks) run eagerly.
GRAPH_MAX_ROW_TOKENS = 16


def _static_len(n: int) -> int:
    """Length of the staged static inputs of graphs of up to n rows (see DecodeCudaGraphs)."""
    return 5 * n + 2


def decode_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Buckets covering 1..max_batch_size (the largest may exceed it)."""
    if not 1 <= max_batch_size <= DECODE_BUCKETS[-1]:
        raise ValueError(f"max_batch_size must be in 1..{DECODE_BUCKETS[-1]}, got {max_batch_size}")
    i = bisect.bisect_left(DECODE_BUCKETS, max_batch_size)
    return DECODE_BUCKETS[: i + 1]


def scratch_block_slots(scratch_block: int, block_size: int, num: int) -> np.ndarray:
    """KV slots of `num` padding rows: spread over the scratch block's offsets."""
    return scratch_block * block_size + np.arange(num, dtype=np.int64) % block_size


class DecodeCudaGraphs:
    """Captured decode graphs over `forward_logits(batch, out)`, which maps a ForwardBatch of
    decode rows to logits [rows, vocab] float32, written into `out` when it is given (else
    new), and must use the backend planned by `backend.prepare_cuda_graph` (see
    FlashInferBackend). Every bucket's graph writes its logits into rows of one buffer, so
    their memory does not grow with the number of buckets. With `lora`, `lora_graphs` holds
    each bucket's graph with the adapters' deltas (see the module docstring)."""

    def __init__(
        self,
        forward_logits: Callable[[ForwardBatch, torch.Tensor | None], torch.Tensor],
        backend,
        *,
        max_batch_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        lora: LoraSlots | None = None,
    ) -> None:
        self.buckets = decode_buckets(max_batch_size)
        self.max_batch_size = self.buckets[-1]
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.backend = backend
        self._forward_logits = forward_logits
        n = self.max_batch_size
        # Static inputs: rows [0, n) of ids | positions | slots, the number of real (unpadded)
        # tokens, then the attention backend's kv_indptr [n + 1] and seq_lens [n] (staged for
        # kernels that build their metadata on the device), filled by one copy per step.
        self._host = torch.zeros(_static_len(n), dtype=torch.int64, pin_memory=True)
        self._static = torch.zeros(_static_len(n), dtype=torch.int64, device=device)
        self._host_indices = torch.zeros(n * max_blocks_per_seq, dtype=torch.int32).pin_memory()
        # FlashInfer's graph-mode plan copies host kv_indices with a blocking copy (a host
        # sync that stalls overlap); staged on the device first, its copy is device-to-device.
        self._device_indices = torch.zeros(n * max_blocks_per_seq, dtype=torch.int32, device=device)
        backend.init_cuda_graph(n, max_blocks_per_seq)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # LoRA graphs beside the base ones: base-only steps launch no empty LoRA kernels
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._lora = lora
        self._lora_segments = (
            None if lora is None else StaticLoraSegments(n, lora.num_slots, device)
        )
        self.num_replays = 0  # graph replays (steps run by a graph)
        self.num_lora_replays = 0  # of which replays of lora_graphs (steps with adapted rows)
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> graph output [bucket, vocab]
        # [max_batch_size, vocab] float32: every graph's output rows (made at the first capture)
        self._logits_out: torch.Tensor | None = None
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(self.buckets):  # largest first: smaller ones reuse its memory
                self._capture(bs, pool)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes up to %d%s) in %.1f s",
            len(self.graphs) + len(self.lora_graphs),
            n,
            ", with and without LoRA" if lora is not None else "",
            time.perf_counter() - start,
        )

    def bucket(self, num_rows: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_rows)]

    def can_run(self, plan: StepPlan, layout: StepLayout) -> bool:
        """Plans of at most max_batch_size tokens in rows of at most GRAPH_MAX_ROW_TOKENS
        that sample something and score no prompt tokens."""
        num_tokens = layout.num_tokens
        return (
            0 < num_tokens <= self.max_batch_size
            and int(layout.num_new.max()) <= GRAPH_MAX_ROW_TOKENS
            and len(layout.sample_tokens) > 0
            and not len(layout.score_tokens)
        )

    def _static_batch(self, bs: int) -> ForwardBatch:
        n = self.max_batch_size
        ids, pos, slots = self._static[:bs], self._static[n : n + bs], self._static[2 * n : 3 * n]
        one = torch.ones(bs, dtype=torch.int32)
        indptr = torch.arange(bs + 1, dtype=torch.int32)
        return ForwardBatch(
            input_ids=ids,
            positions=pos,
            slot_mapping=slots[:bs],
            qo_indptr=indptr.to(ids.device),
            kv_indptr=indptr.to(ids.device),
            kv_indices=torch.full((bs,), self.scratch_block, dtype=torch.int32, device=ids.device),
            kv_last_page_len=one.to(ids.device),
            seq_lens=one.to(ids.device),
            logits_indices=torch.arange(bs, device=ids.device),
            num_decode=bs,
            qo_indptr_cpu=indptr,
            seq_lens_cpu=one,
            kv_indptr_cpu=indptr,
            block_size=self.block_size,
            num_real_tokens=self._static[3 * n : 3 * n + 1],
        )

    def _stage_kv(self, host: np.ndarray, indptr: np.ndarray, seq_lens: np.ndarray) -> None:
        """Write a step's kv_indptr and seq_lens into the host staging buffer."""
        n = self.max_batch_size
        host[3 * n + 1 : 3 * n + 1 + len(indptr)] = indptr
        host[4 * n + 2 : 4 * n + 2 + len(seq_lens)] = seq_lens

    def _plan(self, bs: int, indptr, indices, last_page_len, seq_lens) -> None:
        n = self.max_batch_size
        self.backend.prepare_cuda_graph(
            bs,
            indptr,
            indices,
            last_page_len,
            seq_lens,
            self._static[2 * n : 2 * n + bs],
            self.block_size,
            device_kv_indptr=self._static[3 * n + 1 : 3 * n + 2 + bs],
            device_seq_lens=self._static[4 * n + 2 : 4 * n + 2 + bs],
        )

    def _capture(self, bs: int, pool) -> None:
        n = self.max_batch_size
        host = self._host.numpy()
        host[:] = 0
        host[2 * n : 3 * n] = scratch_block_slots(self.scratch_block, self.block_size, n)
        host[3 * n] = bs
        one = torch.ones(bs, dtype=torch.int32)
        indptr = torch.arange(bs + 1, dtype=torch.int32)
        self._stage_kv(host, indptr.numpy(), one.numpy())
        self._static.copy_(self._host)
        indices = self._device_indices[:bs]
        indices.fill_(self.scratch_block)
        fb = self._static_batch(bs)
        self._plan(bs, indptr, indices, one, one)
        self.graphs[bs] = self._record(fb, pool)
        if self._lora is not None:
            self._lora_segments.fill(np.empty(0, dtype=np.int64), bs)  # every tile empty
            fb.lora = self._lora.graph_batch(self._lora_segments.view(bs))
            try:
                self.lora_graphs[bs] = self._record(fb, pool)
            except Exception:  # LoRA steps then run eagerly, as they did before these graphs
                logger.exception("LoRA decode graph capture failed; LoRA steps run eagerly")
                self._lora = None
                self.lora_graphs.clear()

    @property
    def covers_lora(self) -> bool:
        """Whether steps with adapted rows can replay (`run` with `lora_token_slot`)."""
        return bool(self.lora_graphs)

    def _record(self, fb: ForwardBatch, pool) -> torch.cuda.CUDAGraph:
        """Capture `_forward_logits(fb)` of a bucket of fb.num_decode rows into `pool`."""
        bs = fb.num_decode
        # warm-up: kernel selection, lazy allocations, Triton JIT
        out = None if self._logits_out is None else self._logits_out[:bs]
        warm = self._forward_logits(fb, out)
        if self._logits_out is None:  # the largest bucket, captured first
            assert bs == self.max_batch_size
            self._logits_out = torch.empty_like(warm)
        del warm
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.logits[bs] = self._forward_logits(fb, self._logits_out[:bs])
        return graph

    def run(
        self,
        layout: StepLayout,
        tables: np.ndarray,  # [R, >= blocks used] int32: the rows' block tables
        last_tokens: torch.Tensor,  # [slots] int64 cuda: each slot's last sample
        on_inputs_staged: Callable[[], None] | None = None,
        device_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
        lora_token_slot: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Replay the graph for a step that `can_run`; returns the logits of its samples
        [S, vocab] float32 (`sample_logits`: a view of the graph's output when every token
        is sampled, valid until the next replay). `device_inputs` = (flat token index [D]
        int64, ids [D] int64), both on the device, overwrite those input ids (a draft
        model's drafts). `lora_token_slot` [T] int (each token's LoRA slot, -1: base; None:
        no adapted row) replays the bucket's LoRA graph; it needs `lora`.
        `on_inputs_staged` runs once the inputs' copies are enqueued, before the replay."""
        num_tokens, n = layout.num_tokens, self.max_batch_size
        bs = self.bucket(num_tokens)
        positions, tables = decode_rows(layout, tables)
        meta = decode_metadata(
            layout.host_ids, positions, tables, bs, self.block_size, self.scratch_block
        )
        host = self._host.numpy()
        host[:bs] = meta.input_ids
        host[n : n + bs] = meta.positions
        host[2 * n : 2 * n + bs] = meta.slot_mapping
        host[3 * n] = num_tokens
        self._stage_kv(host, meta.kv_indptr, meta.seq_lens)
        self._static.copy_(self._host, non_blocking=True)
        if len(layout.last_read_tokens):
            dev = self._static.device
            rows = torch.from_numpy(layout.last_read_tokens).to(dev, non_blocking=True)
            slots = torch.from_numpy(layout.last_read_slots).to(dev, non_blocking=True)
            self._static[:bs].index_copy_(0, rows, last_tokens[slots])
        if device_inputs is not None:
            self._static[:bs].index_copy_(0, *device_inputs)
        num = len(meta.kv_indices)
        self._host_indices.numpy()[:num] = meta.kv_indices
        indices = self._device_indices[:num]
        indices.copy_(self._host_indices[:num], non_blocking=True)
        self._plan(
            bs,
            torch.from_numpy(meta.kv_indptr),
            indices,
            torch.from_numpy(meta.kv_last_page_len),
            torch.from_numpy(meta.seq_lens),
        )
        graph = self.graphs[bs]
        if lora_token_slot is not None:
            assert self.covers_lora, "a LoRA step needs graphs captured with lora"
            self._lora_segments.fill(lora_token_slot, bs)
            graph = self.lora_graphs[bs]
            self.num_lora_replays += 1
        if on_inputs_staged is not None:
            on_inputs_staged()
        graph.replay()
        self.num_replays += 1
        return sample_logits(self.logits[bs], layout)


def sample_logits(logits: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """The rows of `logits` ([>= T, vocab]: one per token in flat order) at the step's
    samples [S, vocab]: a view when every token is sampled, else a gather."""
    num_samples = len(layout.sample_tokens)
    if num_samples == layout.num_tokens:  # sample tokens are ascending: all of them
        return logits[:num_samples]
    index = torch.from_numpy(layout.sample_tokens).to(logits.device, non_blocking=True)
    return logits[index]


def decode_rows(layout: StepLayout, tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One decode row per new token of the step: (positions [T] int64, block tables
    [T, blocks] int32). Token j of row r is at position starts[r] + j and reads row r's
    table; a step of one-token rows is returned as is."""
    if layout.num_tokens == len(layout.starts):
        return layout.starts.astype(np.int64), tables
    row_of = np.repeat(np.arange(len(layout.starts)), layout.num_new)
    offsets = np.arange(layout.num_tokens) - layout.qo_indptr[:-1][row_of]
    return layout.starts[row_of].astype(np.int64) + offsets, tables[row_of]


class DecodeMetadata(NamedTuple):
    """Host-side inputs of one padded decode step (bucket rows; rows >= R are padding)."""

    input_ids: np.ndarray  # [bucket] int64: each row's last token; padding 0
    positions: np.ndarray  # [bucket] int64: position of that token; padding 0
    slot_mapping: np.ndarray  # [bucket] int64: its KV slot; padding: slots of the scratch block
    kv_indptr: np.ndarray  # [bucket + 1] int32
    kv_indices: np.ndarray  # [kv_indptr[-1]] int32: real rows' blocks, then one scratch each
    kv_last_page_len: np.ndarray  # [bucket] int32: 1..block_size; padding 1
    seq_lens: np.ndarray  # [bucket] int32: KV length after the step; padding 1


def decode_metadata(
    input_ids: np.ndarray,  # [R] int64: each row's input token (0 where read on the device)
    positions: np.ndarray,  # [R] int: each row's position (= KV already computed)
    tables: np.ndarray,  # [R, >= blocks used] int32: block tables
    bucket: int,
    block_size: int,
    scratch_block: int,
) -> DecodeMetadata:
    """Inputs of a decode-only step of R rows padded to `bucket` rows, with numpy (no
    device work). Row r feeds one token at position positions[r]."""
    num_rows = len(positions)
    assert num_rows <= bucket
    start = positions.astype(np.int64)
    seq_lens = start + 1
    nblocks = (seq_lens + block_size - 1) // block_size
    table = tables[:, : int(nblocks.max())]  # [R, max_blocks] int32
    real_indices = table[np.arange(table.shape[1]) < nblocks[:, None]]  # row-major: in order
    assert not (real_indices == scratch_block).any(), (
        "a request holds the CUDA-graph scratch block: build the BlockAllocator with "
        "runner.num_usable_blocks blocks"
    )
    pad = bucket - num_rows
    pad_slots = scratch_block_slots(scratch_block, block_size, bucket)[num_rows:]
    blocks = table[np.arange(num_rows), start // block_size].astype(np.int64)
    kv_indptr = np.zeros(bucket + 1, dtype=np.int32)
    np.cumsum(np.concatenate([nblocks, np.ones(pad, dtype=np.int64)]), out=kv_indptr[1:])
    ones = np.ones(pad, dtype=np.int32)
    return DecodeMetadata(
        input_ids=np.concatenate([input_ids.astype(np.int64), np.zeros(pad, dtype=np.int64)]),
        positions=np.concatenate([start, np.zeros(pad, dtype=np.int64)]),
        slot_mapping=np.concatenate([blocks * block_size + start % block_size, pad_slots]),
        kv_indptr=kv_indptr,
        kv_indices=np.concatenate([real_indices, np.full(pad, scratch_block, dtype=np.int32)]),
        kv_last_page_len=np.concatenate(
            [(seq_lens - (nblocks - 1) * block_size).astype(np.int32), ones]
        ),
        seq_lens=np.concatenate([seq_lens.astype(np.int32), ones]),
    )
