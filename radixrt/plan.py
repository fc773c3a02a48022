"""The boundary between the scheduler and the model runner: a step plan and its result.

The scheduler decides, the runner executes; they share nothing live. `Scheduler.schedule()`
returns a `StepPlan` (plain data: ids, positions, block ids, sampling parameters), the runner's
`execute(plan)` runs it and hands back a `StepHandle` whose `result()` is a `StepResult` (token
lists per row). The same plan is what rank 0 would send to tensor-parallel ranks, so nothing here
refers to a scheduler object; this module imports neither torch nor the scheduler.

Per slot (an index the scheduler assigns to a sequence while it holds KV) the runner keeps
state across steps. Per-request data travels once, in a `SlotEntry` of the plan in which the
request gets its slot: its sampling parameters and, for rows with penalties, the tokens to
count (prompt, earlier output); the runner then keeps the row's block table, its last sample
(on the device: the next decode step reads it there) and its penalty counts (on the device,
updated from its own samples inside each step). A per-step row carries only ids: the
block-table delta (`table_start`, `new_blocks`), whether its first input token is the slot's
device-resident last sample (`reads_last_sample`, overlap scheduling), its host input ids,
which of its new tokens produce samples (`sample_offsets`; speculative verification samples
at every position) and the RNG step of seeded sampling. Features' data travel as side tables
of the plan: drafts (`drafts`, `device_drafts`) and one grammar bitmask array per step
(`bitmasks`).

Execution order inside `execute`: slot entries (copies first, then the entries in list order),
block table updates, then `block_ops` in list order (the host
tier's swap-outs / swap-ins first, in the order the cache made them, then copies; see
`radixrt.kv.host_pool` for the copy stream and when the forward waits), then one forward over
all rows, then sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from radixrt.sampling import LoraRef, SamplingParams


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


@dataclass
class SwapStats:
    """Host KV tier transfers a runner executed (`Runner.swap_stats`)."""

    blocks_out: int = 0  # device -> host
    blocks_in: int = 0  # host -> device
    bytes_out: int = 0
    bytes_in: int = 0
    seconds: float = 0.0  # copy-stream time (CUDA events) or wall time (CPU)


@dataclass(slots=True)
class PromptLogprobs:
    """Score prompt tokens: log p(targets[i] | ...) from the logits of new token
    `offset + i` of the row."""

    offset: int  # first new token (row-relative) whose logits are scored
    targets: list[int]  # the prompt tokens that follow those positions


@dataclass(slots=True)
class SlotEntry:
    """A sequence takes slot `slot`: the runner (re)sets the slot's per-request state. Entries
    of one plan apply before its rows; `copy_from` reads the source slot as it was before any
    entry of the plan (a fork's children copy their parent while child 0 takes its slot)."""

    slot: int
    incarnation: int  # grows with every slot grant; the runner records it per slot (results
    # of older incarnations are never applied to the slot's state)
    params: SamplingParams
    copy_from: int | None = None  # fork: start from this slot's state (penalty counts)
    prompt_ids: list[int] = field(default_factory=list)  # prompt tokens to count on top
    output_ids: list[int] = field(default_factory=list)  # output tokens to count on top (a
    # re-admitted request's earlier output); both lists only for params.has_penalties
    lora: LoraRef | None = None  # the LoRA adapter the slot's rows run under (None: the base)


@dataclass(slots=True)
class PlanRow:
    rid: str  # request id (for logs and results; the runner keys nothing on it, TP ranks
    # do not receive it)
    slot: int  # runner-side row state (see the module docstring)
    start: int  # absolute position of the row's first new token (= KV already computed)
    num_tokens: int  # new tokens fed this step (q_len): reads_last_sample + len(input_ids)
    # + num_draft_tokens
    input_ids: list[int]  # host token ids of the new tokens before the drafts (without the
    # first when reads_last_sample: then that one is the row's previous sample, read on the
    # device)
    reads_last_sample: bool = False
    table_start: int = 0  # new_blocks go to block-table entries [table_start, ...)
    new_blocks: list[int] = field(default_factory=list)  # block ids to write there
    sample_offsets: list[int] = field(default_factory=list)  # row-relative new tokens to
    # sample from, ascending; empty for a prefill chunk that does not end the prompt
    num_draft_tokens: int = 0  # trailing new tokens that are drafts (the plan's `drafts` or
    # `device_drafts`): the runner accepts the longest prefix of them its samples agree with
    # (then sample_offsets = the last k + 1)
    num_output_before: int = 0  # tokens generated so far (seeded rows' RNG step)
    prompt_logprobs: PromptLogprobs | None = None
    # scheduler bookkeeping (not sent to TP ranks): the features whose next row needs this
    # row's result on the host first ("beam", "grammar", "speculation"); the scheduler does
    # not plan the request again before this step's result arrives
    waits_for_result: list[str] = field(default_factory=list)

    @property
    def end(self) -> int:
        """Absolute position one past the row's last new token (KV length after the step)."""
        return self.start + self.num_tokens


@dataclass(slots=True)
class TokenBitmasks:
    """Structured output: the tokens allowed at each sample of the constrained rows, one
    array for the step: `len(rows)` rows' masks back to back, one mask per sample of each
    row (packed little-endian int32 words, bit set = allowed, ceil(vocab / 32) words each;
    see radixrt.grammar)."""

    rows: list[int]  # plan row indices, ascending
    data: bytes


@dataclass(slots=True)
class StepPlan:
    step_id: int
    rows: list[PlanRow]  # rows with num_tokens == 1 first (the decode kernel), then the rest
    block_ops: list[BlockOp] = field(default_factory=list)
    new_slots: list[SlotEntry] = field(default_factory=list)  # applied first, in order
    drafts: dict[int, list[int]] = field(default_factory=dict)  # row index -> its host drafts
    device_drafts: list[int] = field(default_factory=list)  # rows whose drafts the runner's
    # draft model makes (speculative_method 'draft'), ascending
    bitmasks: TokenBitmasks | None = None

    def row_drafts(self, i: int) -> list[int]:
        """Row i's host drafts ([] for rows without drafts or with device drafts)."""
        return self.drafts.get(i, [])

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
    # tokens of the largest decode CUDA graph (0: no graphs); a decode step feeding more
    # tokens (speculative drafts) runs eagerly
    max_graph_tokens: int

    def execute(self, plan: StepPlan) -> StepHandle:
        """Start the step (on a GPU: enqueue it and return at once)."""
        ...

    def swap_stats(self) -> SwapStats:
        """Totals of the host-tier transfers (SwapOut / SwapIn) executed so far, a failed
        step's too if it got that far (all zero without a host tier)."""
        ...

    def check_health(self) -> None:
        """Raise if the runner can no longer run steps (e.g. a tensor-parallel rank died).
        Cheap: no collective, no device sync."""
        ...

    def close(self) -> None:
        """Release what the runner holds (worker processes); idempotent."""
        ...
