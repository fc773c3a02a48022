"""The runner's host layout of a step plan: the decode fast path equals the general one."""

import dataclasses
import random

import numpy as np
import pytest

from radixrt.executor.inputs import _decode_layout, general_layout, layout_plan
from radixrt.plan import PlanRow, PromptLogprobs, StepPlan
from radixrt.sampling import SamplingParams

SLOT_PARAMS = [
    SamplingParams(temperature=random.Random(s).choice([0.0, 0.7]), max_tokens=8) for s in range(64)
]


def _decode_row(rng: random.Random, i: int, reads_last: bool) -> PlanRow:
    return PlanRow(
        rid=f"r{i}",
        slot=rng.randrange(64),
        start=rng.randrange(1, 500),
        num_tokens=1,
        input_ids=[] if reads_last else [rng.randrange(1000)],
        reads_last_sample=reads_last,
        sample_offsets=[0],
        num_output_before=rng.randrange(20),
    )


def _assert_same(got, expected) -> None:
    for f in dataclasses.fields(expected):
        a, b = getattr(got, f.name), getattr(expected, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), f.name
        else:
            assert a == b, f.name


@pytest.mark.parametrize("num_rows", [1, 5, 32])
@pytest.mark.parametrize("reads", ["none", "all", "mixed"])
def test_decode_fast_path_equals_general_layout(num_rows, reads):
    rng = random.Random(num_rows)
    rows = [
        _decode_row(rng, i, {"none": False, "all": True, "mixed": i % 2 == 1}[reads])
        for i in range(num_rows)
    ]
    plan = StepPlan(7, rows)
    fast = _decode_layout(plan, SLOT_PARAMS)
    assert fast is not None
    _assert_same(fast, general_layout(plan, SLOT_PARAMS))
    _assert_same(layout_plan(plan, SLOT_PARAMS), general_layout(plan, SLOT_PARAMS))


def test_other_plans_take_the_general_path():
    rng = random.Random(3)
    decode = [_decode_row(rng, i, False) for i in range(3)]
    prefill = PlanRow(rid="p", slot=9, start=0, num_tokens=4, input_ids=[1, 2, 3, 4])
    unsampled = dataclasses.replace(decode[0], sample_offsets=[])
    scored = dataclasses.replace(decode[1], prompt_logprobs=PromptLogprobs(0, [5]))
    for rows in ([*decode, prefill], [unsampled, *decode[1:]], [scored, decode[0]]):
        plan = StepPlan(1, rows)
        assert _decode_layout(plan, SLOT_PARAMS) is None
        _assert_same(layout_plan(plan, SLOT_PARAMS), general_layout(plan, SLOT_PARAMS))
