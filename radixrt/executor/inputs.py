"""Host-side layout of one step plan: flat token order, sample and scoring positions.

Built with numpy from the plan and the runner's per-slot sampling parameters (no request
objects, no device work); the runner turns it into a ForwardBatch and sampling inputs. A row's
new tokens are, in order: its last sample (when it reads it on the device), its host input ids,
its drafts (the plan's `drafts`; 0 placeholders for `device_drafts`, written on the device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from radixrt.attention.forward_batch import ForwardBatch
from radixrt.kernels.block_table_host import build_host_metadata
from radixrt.plan import StepPlan
from radixrt.sampling import SamplingParams


@dataclass
class StepLayout:
    """A step's host layout. Read-only once made: arrays may be shared between fields (and
    the step's tensors on a CPU)."""

    num_decode: int  # leading rows with one new token
    starts: np.ndarray  # [R] int32: position of each row's first new token
    num_new: np.ndarray  # [R] int32: new tokens per row
    qo_indptr: np.ndarray  # [R + 1] int32: row r's new tokens are [qo[r], qo[r + 1])
    slots: np.ndarray  # [R] int64: runner slot of each row
    host_ids: np.ndarray  # [T] int64: input ids, 0 where a row reads its last sample
    last_read_tokens: np.ndarray  # [D] int64: flat token index of each device-read input
    last_read_slots: np.ndarray  # [D] int64: the slot whose last sample goes there
    sample_tokens: np.ndarray  # [S] int64: flat token index of each sample, row order
    sample_rows: np.ndarray  # [S] int64: the row of each sample
    sample_params: list[SamplingParams]  # [S]
    seed_offsets: list[int]  # [S]: RNG step of each sample (tokens generated before it)
    row_first_sample: np.ndarray  # [R] int64: index of the row's first sample (where
    # num_samples > 0)
    num_samples: np.ndarray  # [R] int64: samples of each row
    score_tokens: np.ndarray  # [P] int64: flat token index of each prompt token scored
    score_targets: np.ndarray  # [P] int64: the prompt token it scores
    score_rows: list[tuple[int, int, int]]  # (row, first index into score arrays, count)
    one_sample_per_row: bool  # every row samples once: sample i is row i's (a decode step)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])


def layout_plan(plan: StepPlan, slot_params: Sequence[SamplingParams]) -> StepLayout:
    """The host layout of `plan` (reads the plan, mutates nothing); `slot_params[s]`: the
    sampling parameters of the sequence in slot s."""
    decode = _decode_layout(plan, slot_params)
    return decode if decode is not None else general_layout(plan, slot_params)


def general_layout(plan: StepPlan, slot_params: Sequence[SamplingParams]) -> StepLayout:
    """`layout_plan` for any plan (one pass per row and sample; tests compare the decode
    fast path with it)."""
    rows = plan.rows
    num_rows = len(rows)
    starts = np.fromiter((r.start for r in rows), dtype=np.int32, count=num_rows)
    num_new = np.fromiter((r.num_tokens for r in rows), dtype=np.int32, count=num_rows)
    qo = np.zeros(num_rows + 1, dtype=np.int32)
    np.cumsum(num_new, out=qo[1:])
    ids: list[int] = []
    read_tokens: list[int] = []
    read_slots: list[int] = []
    sample_tokens: list[int] = []
    sample_rows: list[int] = []
    sample_params: list[SamplingParams] = []
    seed_offsets: list[int] = []
    first = np.zeros(num_rows, dtype=np.int64)
    counts = np.zeros(num_rows, dtype=np.int64)
    score_tokens: list[int] = []
    score_targets: list[int] = []
    score_rows: list[tuple[int, int, int]] = []
    one_each = True
    for i, r in enumerate(rows):
        base = int(qo[i])
        if r.reads_last_sample:
            read_tokens.append(base)
            read_slots.append(r.slot)
            ids.append(0)
        ids += r.input_ids
        if r.num_draft_tokens:
            ids += plan.drafts.get(i) or [0] * r.num_draft_tokens  # device drafts: placeholders
        assert len(ids) == qo[i + 1], f"row {r.rid}: input ids do not match num_tokens"
        first[i] = len(sample_tokens)
        counts[i] = len(r.sample_offsets)
        one_each = one_each and len(r.sample_offsets) == 1
        params = slot_params[r.slot]
        for j, off in enumerate(r.sample_offsets):
            sample_tokens.append(base + off)
            sample_rows.append(i)
            sample_params.append(params)
            seed_offsets.append(r.num_output_before + j)
        if r.prompt_logprobs is not None and r.prompt_logprobs.targets:
            pl = r.prompt_logprobs
            score_rows.append((i, len(score_tokens), len(pl.targets)))
            score_tokens += range(base + pl.offset, base + pl.offset + len(pl.targets))
            score_targets += pl.targets
    return StepLayout(
        num_decode=plan.num_decode,
        starts=starts,
        num_new=num_new,
        qo_indptr=qo,
        slots=np.fromiter((r.slot for r in rows), dtype=np.int64, count=num_rows),
        host_ids=np.asarray(ids, dtype=np.int64),
        last_read_tokens=np.asarray(read_tokens, dtype=np.int64),
        last_read_slots=np.asarray(read_slots, dtype=np.int64),
        sample_tokens=np.asarray(sample_tokens, dtype=np.int64),
        sample_rows=np.asarray(sample_rows, dtype=np.int64),
        sample_params=sample_params,
        seed_offsets=seed_offsets,
        row_first_sample=first,
        num_samples=counts,
        score_tokens=np.asarray(score_tokens, dtype=np.int64),
        score_targets=np.asarray(score_targets, dtype=np.int64),
        score_rows=score_rows,
        one_sample_per_row=one_each,
    )


def _decode_layout(plan: StepPlan, slot_params: Sequence[SamplingParams]) -> StepLayout | None:
    """`layout_plan` of a plain decode step (every row feeds one token and samples it, none
    scores prompt tokens) in a few passes over the rows; None for any other plan."""
    rows = plan.rows
    for r in rows:
        if (
            r.num_tokens != 1
            or r.sample_offsets != [0]
            or r.prompt_logprobs is not None
            or len(r.input_ids) != 1 - r.reads_last_sample
        ):
            return None
    num_rows = len(rows)
    index = np.arange(num_rows, dtype=np.int64)  # sample i is row i's, at token i
    ones = np.ones(num_rows, dtype=np.int32)
    reads = [i for i, r in enumerate(rows) if r.reads_last_sample]
    empty = index[:0]
    return StepLayout(
        num_decode=num_rows,
        starts=np.fromiter((r.start for r in rows), dtype=np.int32, count=num_rows),
        num_new=ones,
        qo_indptr=np.arange(num_rows + 1, dtype=np.int32),
        slots=np.fromiter((r.slot for r in rows), dtype=np.int64, count=num_rows),
        host_ids=np.fromiter(
            (0 if r.reads_last_sample else r.input_ids[0] for r in rows),
            dtype=np.int64,
            count=num_rows,
        ),
        last_read_tokens=np.asarray(reads, dtype=np.int64) if reads else empty,
        last_read_slots=np.asarray([rows[i].slot for i in reads], dtype=np.int64)
        if reads
        else empty,
        sample_tokens=index,
        sample_rows=index,
        sample_params=[slot_params[r.slot] for r in rows],
        seed_offsets=[r.num_output_before for r in rows],
        row_first_sample=index,
        num_samples=ones.astype(np.int64),
        score_tokens=empty,
        score_targets=empty,
        score_rows=[],
        one_sample_per_row=True,
    )


def host_forward_batch(
    layout: StepLayout,
    block_tables: np.ndarray,  # [slots, max_blocks] int32: the runner's block tables
    block_size: int,
    device: torch.device,
    input_ids: torch.Tensor,  # [T] int64 on `device`: the step's inputs
) -> ForwardBatch:
    """The runner's ForwardBatch off CUDA, its metadata from `build_host_metadata` (few array
    ops: they run with cold caches between forwards). On a CPU the tensors share the numpy
    arrays' memory (no copies; kv_indptr / seq_lens / qo_indptr are the *_cpu tensors
    themselves); on another device they are copies."""
    m = build_host_metadata(
        block_tables,
        layout.slots,
        layout.starts,
        layout.num_new,
        layout.qo_indptr,
        block_size,
        layout.num_decode,
    )
    qo_cpu, seq_lens_cpu = torch.from_numpy(layout.qo_indptr), torch.from_numpy(m.seq_lens)
    kv_indptr_cpu = torch.from_numpy(m.kv_indptr)
    if device.type == "cpu":
        wrap = torch.from_numpy
        qo, kv_indptr, seq_lens = qo_cpu, kv_indptr_cpu, seq_lens_cpu
    else:

        def wrap(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        qo, kv_indptr, seq_lens = map(wrap, (layout.qo_indptr, m.kv_indptr, m.seq_lens))
    return ForwardBatch(
        input_ids=input_ids,
        positions=wrap(m.positions),
        slot_mapping=wrap(m.slot_mapping),
        qo_indptr=qo,
        kv_indptr=kv_indptr,
        kv_indices=wrap(m.kv_indices),
        kv_last_page_len=wrap(m.kv_last_page_len),
        seq_lens=seq_lens,
        logits_indices=wrap(layout.sample_tokens),
        num_decode=layout.num_decode,
        qo_indptr_cpu=qo_cpu,
        seq_lens_cpu=seq_lens_cpu,
        kv_indptr_cpu=kv_indptr_cpu,
        block_size=block_size,
    )
