"""The scheduler half of speculative decoding: drafts for decode rows (plain Python).

A decode row with k drafts feeds its last token plus the drafts and samples at each (k + 1
tokens); the result applier appends the accepted ones and rolls the rest back. The proposer
(`radixrt.speculative`) reads the row's token sequence. Drafts travel in the plan's side tables
(`StepPlan.drafts`; `StepPlan.device_drafts` for the draft model's, made by the runner). A
verify row waits for its result on the host (its length depends on acceptance); a row that did
not draft does not wait, so it overlaps like any other. The rules between speculation and the
other features and the overlapped loop are all here:
- a beam never drafts (its group picks one token per beam from top log-probs);
- a constrained row's drafts are cut at the first one its grammar refuses, and device drafts
  (a draft model's, made on the device) are not used for constrained rows at all;
- a row whose last sample is still in flight does not draft (the proposer needs it);
- with overlap, a step verifies drafts only when they are worth a wait: a step with verify
  rows must have its result on the host before the next is planned (the next row of a verify
  row starts where acceptance ends), which costs the overlap of the whole batch (+20-40% of a
  decode step on the H200, B = 1..256). So the drafted rows of a step (`choose`) verify only
  when the accepted drafts they are expected to bring reach `speculative_min_gain` per decode
  row, the rows expecting most first (without overlap every step waits anyway: all verify).
  Drafts also stay within the runner's largest decode CUDA graph (`max_graph_tokens`): a step
  of more tokens would run eagerly, slower than it gains;
- the engine loop takes the in-flight step's result before planning the next
  (`Scheduler.wants_result_first`) when that step has verify rows (a plan made now would
  leave them out) or when the rows whose samples are in flight could draft, once those
  samples are known, enough to pay for two steps without overlap, twice that test (the wait,
  then the verify step's; `worth_waiting`: rows whose proposer's `may_propose_next` says some
  next token makes it draft), so a row drafts at every position
  where a loop without overlap drafts, from the exact context, and steps that cannot verify
  overlap. (Asking the proposer about the host tokens alone, a context one token short,
  drafted one position late after every divergence: the first verify of each run of matches
  was lost and acceptance fell.)

What a row expects (`_Estimate`, per running request): its accepted drafts per verify (an
average over its recent verify rows; half its drafts before any), and for a wait, the share of
the waits for its sample after which it did draft (`may_propose_next` is true of many more rows
than draft: on random text, most of the batch). An estimate not updated within the row's last
STALE_TOKENS tokens counts as its prior again, so a row whose drafts failed is tried again
once its text may have changed (a few waits per STALE_TOKENS steps on text that never repeats).

A proposer that `indexes` reads a request's tokens through the index its `track` makes (the
ngram proposer's: a lookup then costs O(max_n), not O(context)), one per request, kept here
until the request finishes (`on_finish`; each prefill chunk is indexed as its row is planned);
other proposers read `seq_token_ids` itself.

Verify rows' results are counted here (`on_row_result`): the engine's `SpecStats` and, per
request, the drafts verified and accepted (`verified`, which the engine's deltas report; kept
as long as the request object lives, so that its last delta still reads them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from radixrt.config import SchedulerConfig
from radixrt.plan import PlanRow, StepResult
from radixrt.scheduler.features import Hooks, SchedulerFeature, StepTables
from radixrt.scheduler.request import Request
from radixrt.speculative.base import Proposer, SpecStats, TokenIndex

# A row's estimates (see the module docstring): exponential averages with this weight on the
# newest observation (three verifies that accept nothing take the prior to an eighth), priors
# (PRIOR_SHARE of the drafts accepted; every wait drafts), and the tokens after which an
# estimate not updated is the prior again
NEW_WEIGHT = 0.5
PRIOR_SHARE = 0.5
STALE_TOKENS = 64


@dataclass(slots=True)
class _Estimate:
    accepted: float  # accepted drafts per verify row
    accepted_at: int  # the row's output length when it was last updated
    fires: float  # share of the waits for its sample after which it drafted
    fires_at: int


def _current(value: float, prior: float, at: int, now: int) -> float:
    return prior if now - at >= STALE_TOKENS else value


class SpeculationFeature(SchedulerFeature):
    def __init__(
        self,
        proposer: Proposer,
        cfg: SchedulerConfig,
        stats: SpecStats,
        max_model_len: int,
        hooks: Hooks,
        max_graph_tokens: int = 0,
        overlap: bool = False,
    ) -> None:
        """`hooks`: the features' (their `restricts_drafts` / `allowed_drafts` have a say in the
        drafts); `max_graph_tokens`: the runner's largest decode CUDA graph (0: none);
        `overlap`: whether the engine loop overlaps steps (then steps verify only drafts worth a
        wait)."""
        self.proposer = proposer
        self.num_speculative_tokens = cfg.num_speculative_tokens
        self.min_gain = cfg.speculative_min_gain
        self.max_graph_tokens = max_graph_tokens
        self.overlap = overlap
        self.prior_accepted = PRIOR_SHARE * cfg.num_speculative_tokens
        self._estimates: dict[Request, _Estimate] = {}  # per running request, once it drafts
        self._awaited: set[Request] = set()  # rows whose samples the loop waits for to draft
        self.stats = stats
        self.max_model_len = max_model_len
        self.restricts_drafts = hooks.restricts_drafts
        self.allowed_drafts = hooks.allowed_drafts
        # per request: [drafts verified, of those accepted] (entries go with the request)
        self._verified: WeakKeyDictionary[Request, list[int]] = WeakKeyDictionary()
        # per running request, for a proposer that indexes: its index of the request's tokens
        self._indexes: dict[Request, TokenIndex] = {}

    def verified(self, req: Request) -> tuple[int, int]:
        """Speculative drafts verified for `req` so far, and how many of them were accepted."""
        counts = self._verified.get(req)
        return (counts[0], counts[1]) if counts is not None else (0, 0)

    def drafts(self, req: Request, spare: int) -> list[int]:
        """Draft tokens for a decode row: only with its last token on the host, and room for
        them (max_tokens, the context and `spare` tokens of the step's budget); see the
        module docstring for the rules. Rows with penalties draft: the runner penalises each
        position with the drafts before it counted (`radixrt.executor.penalties`)."""
        if req.num_inflight_samples or not req.reports:
            return []
        constrained = self._constrained(req)
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
        drafts = self.proposer.propose(self._tokens(req), k, req.cache_namespace)[:k]
        if req in self._awaited:
            self._awaited.discard(req)
            e = self._estimate(req)
            old = self._fires(req)
            e.fires, e.fires_at = old + NEW_WEIGHT * (bool(drafts) - old), req.num_output
        if constrained and drafts:
            for allowed in self.allowed_drafts:
                drafts = allowed(req, drafts)
        self.stats.num_proposals += 1
        self.stats.num_proposals_with_drafts += bool(drafts)
        return drafts

    def would_draft(self, req: Request) -> bool:
        """Whether running `req`, whose last sample is in flight, could draft once that
        sample is on the host: it has room for a draft after it and some value of that sample
        makes the proposer draft (`may_propose_next`; a draft model's always does).
        Unconstrained rows only (constrained rows never have a sample in flight)."""
        assert req.num_inflight_samples
        if not req.reports or self._constrained(req):
            return False
        room = min(req.max_tokens - req.num_output, self.max_model_len - req.seq_len) - 2
        if room < 1:
            return False
        return self.proposer.may_propose_next(self._tokens(req), req.cache_namespace)

    def worth_waiting(self, running: Sequence[Request]) -> bool:
        """Whether the loop should wait for the in-flight samples of `running` rows before
        planning: the rows that could draft once their sample is known (`would_draft`) expect
        enough accepted drafts, within the decode graphs, for two steps without overlap (this
        wait, then the verify step's), twice `choose`'s test."""
        self._awaited.clear()
        # a wait and then the verify step's own wait: two steps that do not overlap
        need = 2 * self.min_gain * len(running)
        k = self.num_speculative_tokens
        room = self.max_graph_tokens - len(running) if self.max_graph_tokens else len(running) * k
        if room <= 0:
            return False  # no room for drafts in this step's decode graph
        may = [r for r in running if r.num_inflight_samples and self.would_draft(r)]
        expected = sorted(self._fires(r) * self._accepted(r, k) for r in may)
        gain = 0.0
        while expected and room > 0 and gain < need:
            gain += expected.pop() * min(room, k) / k
            room -= k
        if gain >= need:
            self._awaited.update(may)
            return True
        return False

    def choose(
        self, proposals: list[tuple[Request, list[int]]], num_rows: int, spare: int
    ) -> dict[Request, list[int]]:
        """The drafts this step verifies (see the module docstring): the rows expecting the
        most accepted drafts first, within `spare` tokens and the decode graphs; with overlap,
        none unless their expected accepted drafts reach `min_gain` per decode row
        (`num_rows`)."""
        if self.max_graph_tokens:
            spare = min(spare, self.max_graph_tokens - num_rows)
        ranked = sorted(proposals, key=lambda p: self._accepted(p[0], len(p[1])), reverse=True)
        chosen: dict[Request, list[int]] = {}
        gain = 0.0
        for req, drafts in ranked:
            drafts = drafts[: max(spare, 0)]
            if not drafts:
                break
            spare -= len(drafts)
            chosen[req] = drafts
            gain += self._accepted(req, len(drafts))
        if self.overlap and gain < self.min_gain * num_rows:
            chosen = {}
        self.stats.num_proposals_skipped += len(proposals) - len(chosen)
        return chosen

    def _estimate(self, req: Request) -> _Estimate:
        e = self._estimates.get(req)
        if e is None:
            n = req.num_output
            e = self._estimates[req] = _Estimate(self.prior_accepted, n, 1.0, n)
        return e

    def _accepted(self, req: Request, k: int) -> float:
        """Drafts `req` expects accepted of `k` drafts verified now."""
        e = self._estimates.get(req)
        if e is None:
            return min(self.prior_accepted, k)
        return min(_current(e.accepted, self.prior_accepted, e.accepted_at, req.num_output), k)

    def _fires(self, req: Request) -> float:
        """The share of waits for `req`'s sample after which it drafts, expected now."""
        e = self._estimates.get(req)
        return 1.0 if e is None else _current(e.fires, 1.0, e.fires_at, req.num_output)

    def on_row(
        self, req: Request, row: PlanRow, drafts: list[int], samples: bool, tables: StepTables
    ) -> None:
        if not drafts:
            if row.num_tokens > 1 and req.reports and self.proposer.indexes:
                # a prefill chunk: index it now, not at the row's first draft
                self._index(req).advance(row.end)
            return
        row.waits_for_result.append("speculation")  # the next row starts where acceptance ends
        if self.proposer.drafts_on_device:
            tables.device_drafts.add(id(row))
        else:
            tables.drafts[id(row)] = drafts

    def on_row_result(self, req: Request, row: PlanRow, result: StepResult, i: int) -> bool:
        """Count a verify row's result (the result applier appends the accepted tokens)."""
        k = row.num_draft_tokens
        if k:
            accepted = len(result.tokens[i]) - 1
            self.stats.record_verify(k, accepted)
            counts = self._verified.setdefault(req, [0, 0])
            counts[0] += k
            counts[1] += accepted
            e = self._estimate(req)
            old = self._accepted(req, k)
            e.accepted, e.accepted_at = old + NEW_WEIGHT * (accepted - old), req.num_output
        return False

    def on_finish(self, req: Request) -> None:
        self._indexes.pop(req, None)
        self._estimates.pop(req, None)
        self._awaited.discard(req)

    def check_integrity(self) -> None:
        for req in [*self._estimates, *self._awaited]:
            assert req.finish_reason is None, req.rid  # (on_finish dropped it)
        for req, index in self._indexes.items():
            assert req.finish_reason is None, req.rid  # (on_finish dropped it)
            assert index.tokens is req.seq_token_ids, req.rid
            index.check()

    def _tokens(self, req: Request) -> Sequence[int]:
        """What the proposer reads for `req`: its index, or the token list itself."""
        return self._index(req) if self.proposer.indexes else req.seq_token_ids

    def _index(self, req: Request) -> TokenIndex:
        """The proposer's index of `req`'s tokens (made on first use)."""
        index = self._indexes.get(req)
        if index is None:
            index = self._indexes[req] = self.proposer.track(req.seq_token_ids)
        return index

    def _constrained(self, req: Request) -> bool:
        return any(restricts(req) for restricts in self.restricts_drafts)
