"""The per-request data the runner keeps per slot, sent once: `SlotEntry`s for the next plan
(plain Python).

When a sequence takes a runner slot (admission, a fork's child, a beam re-parented into a
reserved slot) an entry with its sampling parameters and LoRA adapter is queued; with penalties
it carries the tokens the runner counts (the prompt when repetition_penalty needs it, any
earlier output of a re-admitted request), or names the slot it copies (a fork: the parent's) and
the tokens on top.
Each entry gets a new incarnation number. The runner then counts the row's own samples on the
device (`radixrt.executor.penalties`); `Request.num_output_counted` mirrors how many output tokens
its slot counts, so tokens appended on the host without a sample (jump-forward, a beam's pick)
are noticed at the next row and the slot is entered again with the whole output
(`recount_due`). A slot freed before its entry went out drops the entry (`drop`).
"""

from __future__ import annotations

from radixrt.plan import SlotEntry
from radixrt.scheduler.request import Request


class SlotEntries:
    def __init__(self) -> None:
        self.pending: list[SlotEntry] = []  # for the next plan, in order
        self.num_incarnations = 0  # entries made so far (the last incarnation number)

    def enter(self, req: Request, source: Request | None = None) -> None:
        """Queue the entry of `req`'s (new) slot; `source`: a fork parent / beam whose slot
        `req` copies (it holds no sample in flight and its tokens are a prefix of `req`'s)."""
        assert req.slot is not None
        self.num_incarnations += 1
        p = req.params
        entry = SlotEntry(req.slot, self.num_incarnations, p, lora=req.options.lora)
        req.slot_incarnation = self.num_incarnations
        req.num_output_counted = req.num_output
        if p.has_penalties:
            seq, prompt_len = req.seq_token_ids, req.prompt_len
            base = 0
            if source is not None and source.slot is not None:
                assert source.num_inflight_samples == 0
                assert source.prompt_len <= prompt_len
                assert source.seq_token_ids == seq[: len(source.seq_token_ids)]
                entry.copy_from = source.slot
                base = len(source.seq_token_ids)
            if p.repetition_penalty != 1.0:
                entry.prompt_ids = seq[min(base, prompt_len) : prompt_len]
            entry.output_ids = seq[max(base, prompt_len) :]
        self.pending.append(entry)

    def recount_due(self, req: Request) -> bool:
        """Whether `req`'s slot misses output tokens appended on the host without a sample
        (penalised requests only: nothing else reads the counts)."""
        return req.params.has_penalties and req.num_output_counted != req.num_output

    def drop(self, slot: int) -> None:
        """`slot` was freed: its entries not sent yet go."""
        if self.pending:
            self.pending = [e for e in self.pending if e.slot != slot]

    def launch(self) -> list[SlotEntry]:
        """The entries for the plan being made; none stay pending."""
        out, self.pending = self.pending, []
        return out
