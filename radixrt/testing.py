"""A scripted runner: executes step plans without a model (scheduler tests, simulations).

It keeps the row state a real runner keeps (each slot's block table and last sample) and
checks every plan against it, so a plan that would make a real runner read the wrong token or
block fails here too. Tokens come from `token_fn(rid, position) -> token` (the token sampled
after the sequence's first `position` tokens; deterministic by default, so runs with and
without overlap or caching must agree). Plain Python: no torch.

With `context_fn`, the runner also models KV content: each block holds the token ids written
at its positions (rows write their input tokens, copy ops copy), and a sample is
`context_fn(rid, context)` of the context read back through the row's block table, so a
missing or wrong copy-on-write changes the outputs (and reading an unwritten position fails).
Host-tier swap ops copy block contents to and from `host_kv` the same way.
`context_fn` may return a list of (token, log-prob) pairs, best first: the first is the
sample, the list is the row's top log-probs (beam search rows).

Per-slot state follows a real runner's lifecycle: a plan's `SlotEntry`s set each slot's
sampling parameters and incarnation, and for penalised slots the output tokens the slot counts
(`counted`: the entry's, or a copy of another slot's, plus its own samples). Unlike the device,
which counts in the step, this runner appends a step's samples when its result is taken, and
only if the slot still has the incarnation it had when the step ran (a slot granted again while
the step was in flight must not get the old sequence's tokens); `check_slots` compares the
counts with the scheduler's requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from radixrt.config import ModelConfig
from radixrt.plan import (
    CopyBlock,
    SlotEntry,
    StepPlan,
    StepResult,
    SwapIn,
    SwapOut,
    SwapStats,
)
from radixrt.sampling import SamplingParams


def default_token(rid: str, position: int) -> int:
    """A deterministic token for the sample after `position` sequence tokens."""
    return 7 + (hash((rid, position)) & 0xFFFF) % 1000


def scripted_model_config(vocab_size: int, max_position_embeddings: int = 4096) -> ModelConfig:
    """A small Llama-shaped ModelConfig for an engine that a ScriptedRunner drives (the
    scheduler reads the vocabulary and the context length; no layer is built)."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
    )


@dataclass
class ScriptedRunner:
    num_slots: int
    block_size: int
    token_fn: Callable[[str, int], int] = default_token
    # ("execute" | "result" | "plan", step id) in call order: shows whether a loop overlaps
    events: list[tuple[str, int]] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)  # slot -> block table
    last_sample: dict[int, int] = field(default_factory=dict)  # slot -> token (the "device")
    num_computed_tokens: int = 0  # tokens fed, over all steps
    copies: list[CopyBlock] = field(default_factory=list)
    # (rid, context token ids) -> a token, or [(token, log-prob), ...] best first
    context_fn: Callable[[str, Sequence[int]], int | list[tuple[int, float]]] | None = None
    kv: dict[int, list[int | None]] = field(default_factory=dict)  # block -> token per offset
    host_kv: dict[int, list[int | None]] = field(default_factory=dict)  # host block (tier)
    swaps: list[SwapIn | SwapOut] = field(default_factory=list)  # executed, in order
    slot_params: dict[int, SamplingParams] = field(default_factory=dict)  # from entries
    incarnations: dict[int, int] = field(default_factory=dict)  # slot -> its entry's
    counted: dict[int, list[int]] = field(default_factory=dict)  # penalised slot -> outputs
    num_stale_results: int = 0  # samples not counted: their slot was entered again

    # the Runner protocol's sizes: the engine is given num_kv_blocks and takes the host tier's
    # size from its config when a scripted runner drives it
    num_usable_blocks: int = 0
    num_host_blocks: int = 0
    max_graph_tokens: int = 0  # no CUDA graphs

    def swap_stats(self) -> SwapStats:
        """All zero: a scripted runner records its swaps (`swaps`) but copies nothing."""
        return SwapStats()

    def check_health(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _enter(self, entries: list[SlotEntry]) -> None:
        """Apply a plan's slot entries (copies read the slots as they were before)."""
        copies = {
            e.slot: list(self.counted.get(e.copy_from, []))
            for e in entries
            if e.copy_from is not None
        }
        for e in entries:
            self.slot_params[e.slot] = e.params
            self.incarnations[e.slot] = e.incarnation
            if e.params.has_penalties:
                self.counted[e.slot] = copies.get(e.slot, []) + list(e.output_ids)
            else:
                self.counted.pop(e.slot, None)

    def _params(self, slot: int) -> SamplingParams:
        assert slot in self.slot_params, f"slot {slot} has no entry"
        return self.slot_params[slot]

    def check_slots(self, requests) -> None:
        """Each running penalised request's slot counts exactly its host output tokens (call
        between steps, with every taken result applied)."""
        for req in requests:
            if req.slot is not None and req.params.has_penalties:
                assert self.incarnations[req.slot] == req.slot_incarnation, req.rid
                assert self.counted[req.slot] == req.output_token_ids, req.rid

    def execute(self, plan: StepPlan) -> _Handle:
        self.events.append(("execute", plan.step_id))
        self._enter(plan.new_slots)
        if self.context_fn is not None:
            return self._execute_with_content(plan)
        tokens, lps, tops, scores = [], [], [], []
        assert not plan.device_drafts, "the scripted runner has no draft model"
        for i, row in enumerate(plan.rows):
            table = self.tables.setdefault(row.slot, [])
            del table[row.table_start :]
            table += row.new_blocks
            assert len(table) * self.block_size >= row.end, f"{row.rid}: no block for its KV"
            if row.reads_last_sample:
                assert row.slot in self.last_sample, f"{row.rid}: no sample on the device"
            self.num_computed_tokens += row.num_tokens
            out: list[int] = []
            if row.sample_offsets:
                n = len(row.sample_offsets)
                if row.num_draft_tokens:
                    # the true samples at the k + 1 positions; drafts accepted while equal
                    k = row.num_draft_tokens
                    drafts = plan.row_drafts(i)
                    first = row.start + row.sample_offsets[0] + 1
                    true = [self.token_fn(row.rid, first + i) for i in range(k + 1)]
                    accept = 0
                    while accept < k and drafts[accept] == true[accept]:
                        accept += 1
                    out = true[: accept + 1]
                else:
                    assert n == 1
                    out = [self.token_fn(row.rid, row.start + row.sample_offsets[0] + 1)]
                if not row.num_draft_tokens:
                    self.last_sample[row.slot] = out[-1]
            tokens.append(out)
            params = self._params(row.slot)
            lps.append([-0.5] * len(out) if params.logprobs else [])
            k = params.top_logprobs
            tops.append([[(t, -0.5)] + [(0, -9.0)] * (k - 1) for t in out] if k else [])
            pl = row.prompt_logprobs
            scores.append([-1.0] * len(pl.targets) if pl is not None else [])
        self.copies += [op for op in plan.block_ops if isinstance(op, CopyBlock)]
        self.swaps += [op for op in plan.block_ops if isinstance(op, SwapIn | SwapOut)]
        return self._handle(plan, StepResult(plan.step_id, tokens, lps, tops, scores))

    def _handle(self, plan: StepPlan, result: StepResult) -> _Handle:
        """The step's handle; its samples count in their slots when it is taken."""
        counts = [
            (row.slot, self.incarnations[row.slot], toks)
            for row, toks in zip(plan.rows, result.tokens)
            if toks and row.slot in self.counted
        ]
        return _Handle(self, result, counts)

    def _execute_with_content(self, plan: StepPlan) -> _Handle:
        bs = self.block_size
        for op in plan.block_ops:
            if isinstance(op, SwapOut):  # host tier: the block's content, copied
                self.host_kv[op.host_block] = list(self.kv.get(op.device_block, [None] * bs))
                self.swaps.append(op)
                continue
            if isinstance(op, SwapIn):
                assert op.host_block in self.host_kv, f"load of unwritten host block {op}"
                self.kv[op.device_block] = list(self.host_kv[op.host_block])
                self.swaps.append(op)
                continue
            src = self.kv.setdefault(op.src, [None] * bs)
            self.kv.setdefault(op.dst, [None] * bs)[: op.num_tokens] = src[: op.num_tokens]
            self.copies.append(op)
        tokens, lps, tops, scores = [], [], [], []
        for row in plan.rows:
            assert not row.num_draft_tokens, "content mode does not model drafts"
            params = self._params(row.slot)
            table = self.tables.setdefault(row.slot, [])
            del table[row.table_start :]
            table += row.new_blocks
            assert len(table) * bs >= row.end, f"{row.rid}: no block for its KV"
            ids = list(row.input_ids)
            if row.reads_last_sample:
                ids = [self.last_sample[row.slot]] + ids
            assert len(ids) == row.num_tokens
            for p, t in zip(range(row.start, row.end), ids):
                self.kv.setdefault(table[p // bs], [None] * bs)[p % bs] = t
            self.num_computed_tokens += row.num_tokens
            out, top = [], []
            for o in row.sample_offsets:
                context = [self.kv[table[p // bs]][p % bs] for p in range(row.start + o + 1)]
                assert None not in context, f"{row.rid}: reads KV nobody wrote"
                value = self.context_fn(row.rid, context)
                if isinstance(value, list):
                    out.append(value[0][0])
                    top.append(value[: params.top_logprobs])
                else:
                    out.append(value)
                    top.append([(value, -0.5)] * params.top_logprobs)
            if out:
                self.last_sample[row.slot] = out[-1]
            tokens.append(out)
            lps.append([-0.5] * len(out) if params.logprobs else [])
            tops.append(top if params.top_logprobs else [])
            pl = row.prompt_logprobs
            scores.append([-1.0] * len(pl.targets) if pl is not None else [])
        return self._handle(plan, StepResult(plan.step_id, tokens, lps, tops, scores))

    def watch(self, scheduler) -> None:
        """Log each `scheduler.schedule()` call as ("plan", step id or -1) in `events`."""
        schedule = scheduler.schedule

        def logged():
            plan = schedule()
            self.events.append(("plan", -1 if plan is None else plan.step_id))
            return plan

        scheduler.schedule = logged

    def overlapped(self) -> bool:
        """Whether every step's result was taken only after the next plan was made (a plan,
        or a schedule() that found nothing to run): needs `watch`."""
        return self.num_waits() == 0

    def num_waits(self) -> int:
        """Steps whose result was taken before the next plan was made (needs `watch`); a
        result whose `execute` is no longer in `events` (cleared since) is not counted."""
        executed_at = {}
        waits = 0
        for n, (kind, i) in enumerate(self.events):
            if kind == "execute":
                executed_at[i] = n
            elif kind == "result" and i in executed_at:
                between = self.events[executed_at[i] + 1 : n]
                waits += not any(k == "plan" for k, _ in between)
        return waits


@dataclass
class _Handle:
    runner: ScriptedRunner
    value: StepResult
    counts: list[tuple[int, int, list[int]]]  # (slot, its incarnation then, samples)
    taken: bool = False

    def result(self) -> StepResult:
        self.runner.events.append(("result", self.value.step_id))
        if not self.taken:
            self.taken = True
            r = self.runner
            for slot, incarnation, toks in self.counts:
                if r.incarnations[slot] == incarnation:
                    r.counted[slot] += toks
                else:
                    r.num_stale_results += len(toks)
        return self.value
