"""A request's state inside the scheduler."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from radixrt.sampling import SamplingParams

_arrival_counter = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_len: int
    token_ids: list[int]  # prompt + generated tokens
    params: SamplingParams
    status: Status = Status.WAITING
    arrival: int = field(default_factory=lambda: next(_arrival_counter))  # FCFS order
    block_table: list[int] = field(default_factory=list)  # KV blocks, position p -> [p // B]
    table_row: int | None = None  # row in the scheduler's BlockTableArray while it holds blocks
    num_computed: int = 0  # tokens of token_ids whose KV is in block_table
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    cache_handle: Any = None  # locked prefix-cache node, None when nothing is locked
    waited_steps: int = 0  # scheduler steps spent waiting (aging)
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    output_logprobs: list[float] = field(default_factory=list)  # when params.logprobs
    # when params.prompt_logprobs: log-probs of prompt tokens [logprob_start_len, prompt_len)
    prompt_logprobs: list[float] = field(default_factory=list)
    admission_seq: int = 0  # order of the latest admission (preemption picks the newest)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_pending(self) -> int:
        """Tokens still to feed through the model before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
