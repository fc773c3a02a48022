"""The boundary between the scheduler and the model runner: a step plan and its result.

The scheduler decides, the runner executes; they share nothing live. `Scheduler.schedule()`
returns a `StepPlan` (plain data: ids, positions, block ids, sampling parameters), the runner's
`execute(plan)` runs it and hands back a `StepHandle` whose `result()` is a `StepResult` (token
lists per row). The same plan is what rank 0 would send to tensor-parallel ranks, so nothing here
refers to a scheduler object; this module imports neither torch nor the scheduler.

Per row, the runner keeps state across steps in a *slot* (an index the scheduler assigns to a
request while it holds KV): a copy of the row's block table and the last token the row sampled,
which stays on the device. A plan row says how to change the block table (`table_start`,
`new_blocks`), whether its first input token is that device-resident last sample
(`reads_last_sample`, overlap scheduling), its host input ids, which of its new tokens produce
samples (`sample_offsets`, a list: speculative verification samples at every position) and how
many trailing input tokens are drafts to verify.

Execution order inside `execute`: block table updates, then `block_ops` in list order (the host
tier's swap-outs / swap-ins first, in the order the cache made them, then copies; see
`radixrt.kv.host_pool` for the copy stream and when the forward waits), then one forward over
all rows, then sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from radixrt.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class CopyBlock:
    """Copy the first `num_tokens` tokens of block `src` into block `dst` (every layer, K
    and V): copy-on-write of a partially matched block."""

    src: int
    dst: int
    num_tokens: int  # 1..block_size


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Write device block `device_block` to host block `host_block` (host KV tier)."""

    device_block: int
    host_block: int


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Load host block `host_block` into device block `device_block` (host KV tier)."""

    host_block: int
    device_block: int


BlockOp = CopyBlock | SwapOut | SwapIn


@dataclass(slots=True)
class PromptLogprobs:
    """Score prompt tokens: log p(targets[i] | ...) from the logits of new token
    `offset + i` of the row."""

    offset: int  # first new token (row-relative) whose logits are scored
    targets: list[int]  # the prompt tokens that follow those positions


@dataclass(slots=True)
class PlanRow:
    rid: str  # request id (for logs and results; the runner keys nothing on it)
    slot: int  # runner-side row state: block table copy + last sampled token
    start: int  # absolute position of the row's first new token (= KV already computed)
    num_tokens: int  # new tokens fed this step (q_len)
    input_ids: list[int]  # host token ids of the new tokens (all but the first when
    # reads_last_sample: then that one is the row's previous sample, read on the device)
    reads_last_sample: bool = False
    table_start: int = 0  # new_blocks go to block-table entries [table_start, ...)
    new_blocks: list[int] = field(default_factory=list)  # block ids to write there
    sample_offsets: list[int] = field(default_factory=list)  # row-relative new tokens to
    # sample from, ascending; empty for a prefill chunk that does not end the prompt
    num_draft_tokens: int = 0  # trailing input tokens that are drafts: the runner accepts the
    # longest prefix of them its samples agree with (then sample_offsets = the last k + 1)
    params: SamplingParams = field(default_factory=SamplingParams)
    num_output_before: int = 0  # tokens generated so far (seeded rows' RNG step)
    history: list[int] | None = None  # prompt + output ids; only for rows with penalties
    prompt_len: int = 0  # length of the prompt within `history`
    prompt_logprobs: PromptLogprobs | None = None
    needs_host_result: bool = False  # the next plan needs this row's result on the host
    # first (penalties, beam search, host-side drafting, grammar masks): the scheduler does
    # not plan the row again before this step's result arrives
    drafts_on_device: bool = False  # the trailing num_draft_tokens input ids are
    # placeholders: the runner's draft model writes the drafts (speculative_method 'draft')
    token_bitmask: bytes | None = None  # structured output: the tokens allowed at each of the
    # row's samples, one mask per sample back to back (packed little-endian int32 words, bit
    # set = allowed, ceil(vocab / 32) words each; see radixrt.grammar)

    @property
    def end(self) -> int:
        """Absolute position one past the row's last new token (KV length after the step)."""
        return self.start + self.num_tokens


@dataclass(slots=True)
class StepPlan:
    step_id: int
    rows: list[PlanRow]  # rows with num_tokens == 1 first (the decode kernel), then the rest
    block_ops: list[BlockOp] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def num_decode(self) -> int:
        """Leading rows that feed one token (the runner's decode rows)."""
        n = 0
        for r in self.rows:
            if r.num_tokens != 1:
                break
            n += 1
        return n


@dataclass(slots=True)
class StepResult:
    """What one executed plan produced, row by row (index i is plan.rows[i])."""

    step_id: int
    tokens: list[list[int]]  # accepted tokens per row: [] (no sample), 1, or 1..k+1 with drafts
    logprobs: list[list[float]]  # log-prob of each accepted token, rows with params.logprobs
    # (else [])
    top_logprobs: list[list[list[tuple[int, float]]]]  # per accepted token: the
    # params.top_logprobs most likely (token, log-prob), rows that asked (else [])
    prompt_logprobs: list[list[float]]  # per row: scores of prompt_logprobs.targets (else [])


class StepHandle(Protocol):
    def result(self) -> StepResult:
        """Block until the step's outputs are on the host."""
        ...


class Runner(Protocol):
    """What EngineCore drives: ModelRunner, TensorParallelRunner, ScriptedRunner."""

    num_usable_blocks: int  # device KV blocks the scheduler's allocator manages
    num_host_blocks: int  # host KV tier blocks (0: no host tier)

    def execute(self, plan: StepPlan) -> StepHandle:
        """Start the step (on a GPU: enqueue it and return at once)."""
        ...

    def check_health(self) -> None:
        """Raise if the runner can no longer run steps (e.g. a tensor-parallel rank died).
        Cheap: no collective, no device sync."""
        ...

    def close(self) -> None:
        """Release what the runner holds (worker processes); idempotent."""
        ...
