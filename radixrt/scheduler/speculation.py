"""The scheduler half of speculative decoding: drafts for decode rows (plain Python).

A decode row with k drafts feeds its last token plus the drafts and samples at each (k + 1
tokens); the result applier appends the accepted ones and rolls the rest back. The proposer
(`radixrt.speculative`) reads the row's token sequence; a host proposer's rows wait for their
result on the host (the next proposal reads the new tokens). The rules between speculation and
the other features are all here, in `drafts`:
- a beam never drafts (its group picks one token per beam from top log-probs);
- a constrained row's drafts are cut at the first one its grammar refuses, and device drafts
  (a draft model's, made on the device) are not used for constrained rows at all;
- a row whose last sample is still in flight does not draft (the proposer needs it).
"""

from __future__ import annotations

from radixrt.config import SchedulerConfig
from radixrt.plan import PlanRow
from radixrt.scheduler.features import SchedulerFeature
from radixrt.scheduler.grammar import GrammarFeature
from radixrt.scheduler.request import Request
from radixrt.scheduler.stats import SchedulerStats
from radixrt.speculative.base import Proposer


class SpeculationFeature(SchedulerFeature):
    def __init__(
        self,
        proposer: Proposer,
        cfg: SchedulerConfig,
        stats: SchedulerStats,
        max_model_len: int,
        grammar: GrammarFeature | None,
    ) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = cfg.num_speculative_tokens
        self.stats = stats
        self.max_model_len = max_model_len
        self.grammar = grammar

    def drafts(self, req: Request, spare: int) -> list[int]:
        """Draft tokens for a decode row: only with its last token on the host, and room for
        them (max_tokens, the context and `spare` tokens of the step's budget); see the
        module docstring for the rules. Rows with penalties draft: the runner penalises each
        position with the drafts before it counted (`radixrt.engine.spec_penalties`)."""
        if req.num_inflight_samples or not req.reports:
            return []
        constrained = req.grammar is not None
        if constrained and self.proposer.drafts_on_device:
            return []  # device drafts cannot be checked against the grammar
        room = min(
            req.max_tokens - req.num_output - 1,
            self.max_model_len - len(req.seq_token_ids) - 1,
            spare,
        )
        k = min(self.num_speculative_tokens, room)
        if k <= 0:
            return []
        drafts = self.proposer.propose(req.seq_token_ids, k, req.cache_salt)[:k]
        if constrained and drafts:
            assert self.grammar is not None
            drafts = self.grammar.allowed_drafts(req, drafts)
        self.stats.spec.num_proposals += 1
        self.stats.spec.num_proposals_with_drafts += bool(drafts)
        return drafts

    def on_row(self, req: Request, row: PlanRow, drafts: list[int], samples: bool) -> None:
        # the proposer reads the sequence: every row waits for its result on the host
        row.needs_host_result = True
        row.drafts_on_device = bool(drafts) and self.proposer.drafts_on_device
