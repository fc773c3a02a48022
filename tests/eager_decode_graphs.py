"""A CPU stand-in for DecodeCudaGraphs that runs the model eagerly from the same host
metadata the graphs replay with (`decode_rows` + `decode_metadata`, no padding), so the
verify-rows-as-decode-rows path and the runner's graph-path wiring run on CPU. LoRA steps
take the graphs' LoRA inputs: padded static segments of the step's bucket, filled from its
token -> slot map, through the segmented kernels (Triton's interpreter on CPU)."""

from __future__ import annotations

import numpy as np
import torch

from radixrt.attention.forward_batch import ForwardBatch
from radixrt.executor.cuda_graph import (
    DecodeCudaGraphs,
    decode_buckets,
    decode_metadata,
    decode_rows,
    sample_logits,
)
from radixrt.kernels.lora import StaticLoraSegments


class EagerDecodeGraphs:
    def __init__(self, runner, max_batch_size: int = 256) -> None:
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.buckets = decode_buckets(max_batch_size)
        self.calls: list[tuple[int, int, int]] = []  # (rows, tokens, samples) of every run
        self.num_replays = self.num_lora_replays = 0
        self.lora_buckets: list[tuple[int, int]] = []  # (tokens, bucket) of every LoRA run
        self._lora_segments = None
        if runner.lora is not None:
            self._lora_segments = StaticLoraSegments(
                self.buckets[-1], runner.lora.num_slots, runner.device
            )

    can_run = DecodeCudaGraphs.can_run
    bucket = DecodeCudaGraphs.bucket

    @property
    def covers_lora(self) -> bool:
        return self._lora_segments is not None

    def run(
        self,
        layout,
        tables,
        last_tokens,
        on_inputs_staged=None,
        device_inputs=None,
        lora_token_slot=None,
    ):
        runner = self.runner
        num_tokens, bs = layout.num_tokens, runner.block_size
        positions, tables = decode_rows(layout, tables)
        scratch = runner.pool.num_blocks  # no padding rows: never referenced
        meta = decode_metadata(layout.host_ids, positions, tables, num_tokens, bs, scratch)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        ids = t(meta.input_ids).clone()
        if len(layout.last_read_tokens):
            ids[t(layout.last_read_tokens)] = last_tokens[t(layout.last_read_slots)]
        if device_inputs is not None:
            ids.index_copy_(0, *device_inputs)
        indptr = torch.arange(num_tokens + 1, dtype=torch.int32)
        fb = ForwardBatch(
            input_ids=ids,
            positions=t(meta.positions),
            slot_mapping=t(meta.slot_mapping),
            qo_indptr=indptr,
            kv_indptr=t(meta.kv_indptr),
            kv_indices=t(meta.kv_indices),
            kv_last_page_len=t(meta.kv_last_page_len),
            seq_lens=t(meta.seq_lens),
            logits_indices=torch.arange(num_tokens),
            num_decode=num_tokens,
            qo_indptr_cpu=indptr,
            seq_lens_cpu=t(meta.seq_lens),
            kv_indptr_cpu=t(meta.kv_indptr),
            block_size=bs,
        )
        if lora_token_slot is not None:
            bucket = self.bucket(num_tokens)  # rows past num_tokens: padding, in the tiles only
            self._lora_segments.fill(lora_token_slot, bucket)
            fb.lora = runner.lora.graph_batch(self._lora_segments.view(bucket))
            self.lora_buckets.append((num_tokens, bucket))
            self.num_lora_replays += 1
        self.num_replays += 1
        runner.backend.prepare(fb)
        if on_inputs_staged is not None:
            on_inputs_staged()
        self.calls.append((len(layout.starts), num_tokens, len(layout.sample_tokens)))
        return sample_logits(runner._decode_logits(fb), layout)
