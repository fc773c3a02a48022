"""The runner's per-slot row state and the step's device inputs built from it.

A slot is the runner-side home of one running sequence. Its state has a lifecycle:
- set by the `SlotEntry` of the plan in which the sequence takes the slot (sampling
  parameters, the incarnation; runner features set theirs from the same entry, e.g. penalty
  counts in `radixrt.executor.penalties`), a fork's entry copying its parent's slot;
- changed by each step: block-table deltas from the plan rows (before the forward) and the
  last sample (on the device, after sampling; `last_tokens`);
- never cleared: the next entry for the slot overwrites it. A slot freed and granted again
  while a step of its previous sequence is in flight is safe because plans execute in order on
  one stream: the old step's device updates land before the new entry resets the slot. The
  incarnation is recorded per slot for state applied outside that order (host-side results).

`forward_batch(layout)` builds a step's ForwardBatch from the state: it is what the target
model and the draft model (over the same block tables) run on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixrt.attention.forward_batch import ForwardBatch
from radixrt.executor.inputs import StepLayout, host_forward_batch
from radixrt.plan import SlotEntry, StepPlan
from radixrt.sampling import LoraRef, SamplingParams


class SlotState:
    def __init__(
        self, num_slots: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.block_tables = np.zeros((num_slots, max_blocks_per_seq), dtype=np.int32)  # host
        self.last_tokens = torch.zeros(num_slots, dtype=torch.int64, device=device)  # [slots]
        self.params: list[SamplingParams] = [SamplingParams()] * num_slots
        self.loras: list[LoraRef | None] = [None] * num_slots  # each slot's adapter
        self.incarnations = [0] * num_slots  # of the entry that set each slot (0: none yet)

    def enter(self, entries: Sequence[SlotEntry]) -> None:
        """Record each entry's sampling parameters, adapter and incarnation for its slot."""
        for e in entries:
            self.params[e.slot] = e.params
            self.loras[e.slot] = e.lora
            self.incarnations[e.slot] = e.incarnation

    def apply_table_deltas(self, plan: StepPlan) -> None:
        """Write each row's new block ids into its slot's block table."""
        tables = self.block_tables
        for r in plan.rows:
            if r.new_blocks:
                tables[r.slot, r.table_start : r.table_start + len(r.new_blocks)] = r.new_blocks

    def forward_batch(self, layout: StepLayout) -> ForwardBatch:
        """The step's ForwardBatch: inputs copied to the device, device-resident last samples
        gathered in, attention metadata built from the slots' block tables."""
        bs, dev = self.block_size, self.device
        to_dev = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
        input_ids = to_dev(layout.host_ids)
        if len(layout.last_read_tokens):
            input_ids[to_dev(layout.last_read_tokens)] = self.last_tokens[
                to_dev(layout.last_read_slots)
            ]
        if dev.type != "cuda":
            return host_forward_batch(layout, self.block_tables, bs, dev, input_ids)
        from radixrt.kernels import build_kv_metadata, build_token_metadata

        seq_lens = layout.starts + layout.num_new
        nblocks = (seq_lens + bs - 1) // bs
        kv_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
        np.cumsum(nblocks, out=kv_indptr[1:])
        tables = self.block_tables[layout.slots, : int(nblocks.max())]
        tables_d, seq_lens_d, start_d, new_d, qo_d = map(
            to_dev, (tables, seq_lens, layout.starts, layout.num_new, layout.qo_indptr)
        )
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
