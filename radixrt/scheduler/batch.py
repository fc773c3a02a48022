"""What the scheduler hands the runner each step and gets back, and the block-table
array the runner slices a step's block tables from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from radixrt.scheduler.request import Request


@dataclass
class ScheduledBatch:
    rows: list[Request]  # decode rows first, then extend rows
    num_new: list[int]  # tokens fed per row this step
    num_decode: int  # rows [0, num_decode) feed one token and sample
    table_rows: np.ndarray  # [R] int: each row's index in the BlockTableArray

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class StepOutput(NamedTuple):
    tokens: list[int]  # sampled token per row (0 for rows that did not sample)
    logprobs: list[float] | None  # log-prob of each sampled token, when any row asked
    prompt_logprobs: dict[int, list[float]]  # row -> log-probs of its prompt tokens this step


class BlockTableArray:
    """Rows of block ids for running requests, kept as one numpy array so a step's
    block tables are sliced out at once instead of rebuilt from Python lists."""

    def __init__(self, max_rows: int, max_blocks_per_row: int) -> None:
        self.table = np.zeros((max_rows, max_blocks_per_row), dtype=np.int32)
        self._free_rows = list(range(max_rows - 1, -1, -1))

    def acquire(self) -> int:
        return self._free_rows.pop()

    def release(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, blocks: Sequence[int]) -> None:
        self.table[row, start : start + len(blocks)] = blocks
