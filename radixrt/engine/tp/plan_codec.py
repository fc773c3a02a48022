"""Step plans as bytes, for rank 0 to broadcast to the other tensor-parallel ranks.

msgspec msgpack of one tuple per row (PlanRow's fields in order). SamplingParams are sent
once: the encoder numbers every params object it has sent (by identity, holding a reference
so the identity stays valid) and rows carry that number; the decoder keeps the same table.
After `MAX_PARAMS` entries both sides start a new table (the message says so).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgspec

from radixrt.plan import CopyBlock, PlanRow, PromptLogprobs, StepPlan, SwapIn, SwapOut
from radixrt.sampling import SamplingParams

MAX_PARAMS = 1 << 14
# PlanRow fields in the order of a row tuple; `params` travels as a table index and
# `prompt_logprobs` as [offset, targets] or None.
ROW_FIELDS = (
    "rid",
    "slot",
    "start",
    "num_tokens",
    "input_ids",
    "reads_last_sample",
    "table_start",
    "new_blocks",
    "sample_offsets",
    "num_draft_tokens",
    "params",
    "num_output_before",
    "history",
    "prompt_len",
    "prompt_logprobs",
    "needs_host_result",
    "drafts_on_device",
    "token_bitmask",
)
assert tuple(f.name for f in fields(PlanRow)) == ROW_FIELDS, "PlanRow changed: update the codec"
PARAMS_AT = ROW_FIELDS.index("params")
PROMPT_LOGPROBS_AT = ROW_FIELDS.index("prompt_logprobs")
OP_KINDS = (CopyBlock, SwapOut, SwapIn)


class ControlKind:
    PLAN = 0  # run this step plan
    STOP = 1  # leave the loop and exit
    COMPARE_LAST_TOKENS = 2  # send rank 0 the slots' last samples (consistency check)


# (kind, step id, new table?, new params, rows, block ops as [kind, a, b(, c)])
Message = tuple[int, int, bool, list[SamplingParams], list[list[Any]], list[list[int]]]


class PlanEncoder:
    def __init__(self) -> None:
        self._index: dict[int, int] = {}  # id(params) -> table index
        self._held: list[SamplingParams] = []  # table order; keeps the ids alive
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, plan: StepPlan) -> bytearray:
        reset = len(self._held) + len(plan.rows) > MAX_PARAMS
        if reset:
            self._index.clear()
            self._held.clear()
        new: list[SamplingParams] = []
        rows = []
        for r in plan.rows:
            i = self._index.get(id(r.params))
            if i is None:
                i = self._index[id(r.params)] = len(self._held)
                self._held.append(r.params)
                new.append(r.params)
            pl = r.prompt_logprobs
            rows.append(
                (
                    r.rid,
                    r.slot,
                    r.start,
                    r.num_tokens,
                    r.input_ids,
                    r.reads_last_sample,
                    r.table_start,
                    r.new_blocks,
                    r.sample_offsets,
                    r.num_draft_tokens,
                    i,
                    r.num_output_before,
                    r.history,
                    r.prompt_len,
                    None if pl is None else (pl.offset, pl.targets),
                    r.needs_host_result,
                    r.drafts_on_device,
                    r.token_bitmask,
                )
            )
        ops = [_op(op) for op in plan.block_ops]
        return self._bytes((ControlKind.PLAN, plan.step_id, reset, new, rows, ops))

    def control(self, kind: int) -> bytearray:
        """A message without a plan (STOP, COMPARE_LAST_TOKENS)."""
        return self._bytes((kind, 0, False, [], [], []))

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
        self._table: list[SamplingParams] = []
        self._decoder = msgspec.msgpack.Decoder(Message)

    def decode(self, data: bytes | bytearray) -> tuple[int, StepPlan | None]:
        """(ControlKind, the plan for PLAN messages else None)."""
        kind, step_id, reset, new, rows, ops = self._decoder.decode(data)
        if kind != ControlKind.PLAN:
            return kind, None
        if reset:
            self._table.clear()
        self._table += new
        table = self._table
        plan_rows = []
        for t in rows:
            t[PARAMS_AT] = table[t[PARAMS_AT]]
            pl = t[PROMPT_LOGPROBS_AT]
            if pl is not None:
                t[PROMPT_LOGPROBS_AT] = PromptLogprobs(pl[0], pl[1])
            plan_rows.append(PlanRow(*t))
        block_ops = [OP_KINDS[op[0]](*op[1:]) for op in ops]
        return kind, StepPlan(step_id, plan_rows, block_ops)
