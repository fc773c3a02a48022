"""Step plans as bytes, for rank 0 to broadcast to the other tensor-parallel ranks.

msgspec msgpack of one tuple per message: the plan's slot entries (per-request data, sent once
when a sequence takes its slot: sampling parameters and penalty tokens), one tuple per row
(the `ROW_FIELDS` of PlanRow: ids, positions, the block-table delta, sample offsets; not the
request id or scheduler bookkeeping, which the ranks never read), the block ops and the side
tables (drafts, device-draft rows, the grammar bitmask array).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgspec

from radixrt.plan import (
    CopyBlock,
    PlanRow,
    PromptLogprobs,
    SlotEntry,
    StepPlan,
    SwapIn,
    SwapOut,
    TokenBitmasks,
)

# PlanRow fields a row tuple carries, in order; `prompt_logprobs` as [offset, targets] or None.
ROW_FIELDS = (
    "slot",
    "start",
    "num_tokens",
    "input_ids",
    "reads_last_sample",
    "table_start",
    "new_blocks",
    "sample_offsets",
    "num_draft_tokens",
    "num_output_before",
    "prompt_logprobs",
)
NOT_SENT = ("rid", "waits_for_result")  # scheduler-side only
assert {f.name for f in fields(PlanRow)} == {*ROW_FIELDS, *NOT_SENT}, (
    "PlanRow changed: update the codec"
)
assert tuple(f.name for f in fields(SlotEntry)) == (
    "slot",
    "incarnation",
    "params",
    "copy_from",
    "prompt_ids",
    "output_ids",
    "lora",
), "SlotEntry changed: update the codec"
PROMPT_LOGPROBS_AT = ROW_FIELDS.index("prompt_logprobs")
OP_KINDS = (CopyBlock, SwapOut, SwapIn)


class ControlKind:
    PLAN = 0  # run this step plan
    STOP = 1  # leave the loop and exit
    COMPARE_LAST_TOKENS = 2  # send rank 0 the slots' last samples (consistency check)


# (kind, step id, slot entries, rows, block ops as [kind, a, b(, c)], drafts, device-draft
# rows, bitmasks as (rows, data) or None)
Message = tuple[
    int,
    int,
    list[SlotEntry],
    list[list[Any]],
    list[list[int]],
    dict[int, list[int]],
    list[int],
    tuple[list[int], bytes] | None,
]


class PlanEncoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, plan: StepPlan) -> bytearray:
        rows = []
        for r in plan.rows:
            pl = r.prompt_logprobs
            rows.append(
                (
                    r.slot,
                    r.start,
                    r.num_tokens,
                    r.input_ids,
                    r.reads_last_sample,
                    r.table_start,
                    r.new_blocks,
                    r.sample_offsets,
                    r.num_draft_tokens,
                    r.num_output_before,
                    None if pl is None else (pl.offset, pl.targets),
                )
            )
        ops = [_op(op) for op in plan.block_ops]
        masks = plan.bitmasks
        return self._bytes(
            (
                ControlKind.PLAN,
                plan.step_id,
                plan.new_slots,
                rows,
                ops,
                plan.drafts,
                plan.device_drafts,
                None if masks is None else (masks.rows, masks.data),
            )
        )

    def control(self, kind: int) -> bytearray:
        """A message without a plan (STOP, COMPARE_LAST_TOKENS)."""
        return self._bytes((kind, 0, [], [], [], {}, [], None))

    def _bytes(self, msg: tuple) -> bytearray:
        buf = bytearray()
        self._encoder.encode_into(msg, buf)
        return buf


def _op(op: CopyBlock | SwapOut | SwapIn) -> list[int]:
    if isinstance(op, CopyBlock):
        return [0, op.src, op.dst, op.num_tokens]
    if isinstance(op, SwapOut):
        return [1, op.device_block, op.host_block]
    return [2, op.host_block, op.device_block]


class PlanDecoder:
    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(Message)

    def decode(self, data: bytes | bytearray) -> tuple[int, StepPlan | None]:
        """(ControlKind, the plan for PLAN messages else None); rows get rid ""."""
        kind, step_id, entries, rows, ops, drafts, device_drafts, masks = self._decoder.decode(data)
        if kind != ControlKind.PLAN:
            return kind, None
        plan_rows = []
        for t in rows:
            pl = t[PROMPT_LOGPROBS_AT]
            if pl is not None:
                t[PROMPT_LOGPROBS_AT] = PromptLogprobs(pl[0], pl[1])
            plan_rows.append(PlanRow("", *t))
        block_ops = [OP_KINDS[op[0]](*op[1:]) for op in ops]
        return kind, StepPlan(
            step_id,
            plan_rows,
            block_ops,
            new_slots=entries,
            drafts=drafts,
            device_drafts=device_drafts,
            bitmasks=None if masks is None else TokenBitmasks(masks[0], masks[1]),
        )
