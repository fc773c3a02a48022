"""The proposer interface of speculative decoding and its statistics (plain Python).

A host proposer (ngram, radix) drafts tokens for a decode row on the host; the scheduler feeds
the row's last token plus the drafts, the runner samples at every position and accepts the
longest prefix of drafts equal to its samples (see `radixrt.executor.runner`). Drafts are
deterministic given the row's tokens, so the output distribution is exactly that of plain
decoding. The draft-model proposer (`radixrt.speculative.draft`) only says how many drafts a row
gets; the runner makes them on the device and verifies them by rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace


class TokenIndex(Protocol):
    """A proposer's per-request view of a request's append-only token list (`tokens`), read
    in its place (the ngram proposer's n-gram index)."""

    tokens: list[int]

    def __len__(self) -> int: ...

    def __getitem__(self, i): ...

    def advance(self, upto: int) -> None:
        """Index the list's first `upto` tokens now (prefill chunks as they are planned)."""
        ...

    def check(self) -> None:
        """Assert the index is that of its list (O(context); integrity checks)."""
        ...


class Proposer:
    """What the scheduler's speculation half asks of a proposer; proposers subclass it (the
    defaults suit a host proposer that keeps no per-request state)."""

    # True: propose() returns placeholders and the runner's draft model writes the drafts on
    # the device (StepPlan.device_drafts); False: the drafts are the tokens returned
    drafts_on_device: bool = False
    # True: `track` makes a per-request TokenIndex, which the scheduler keeps and passes to
    # `propose` and `may_propose_next` in place of the request's list
    indexes: bool = False

    def propose(
        self, tokens: Sequence[int], max_drafts: int, namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> list[int]:
        """Up to `max_drafts` (>= 1) draft tokens to follow `tokens` (a row's prompt and
        output so far; read only) in the row's cache namespace (a proposer that reads the
        prefix cache reads only that namespace's entries); [] when it has nothing to propose."""
        raise NotImplementedError

    def may_propose_next(
        self, tokens: Sequence[int], namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> bool:
        """Whether `propose(tokens + [t], ...)` drafts for some token t: asked for a row whose
        next token t is still being sampled, so that the loop waits for it only when drafts
        could follow (False only when none can; ngram's is exact). By default True."""
        return True

    def track(self, tokens: list[int]) -> TokenIndex:
        """A TokenIndex over the append-only list `tokens` (proposers with `indexes`)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no per-request index")


@dataclass
class SpecStats:
    """Counters of speculative decoding, kept by the scheduler (any proposer)."""

    num_proposals: int = 0  # decode rows the proposer was asked to draft for
    num_proposals_with_drafts: int = 0  # of those, rows it drafted >= 1 token for (fired)
    # of those, rows whose drafts their step did not verify (expected too few accepted, or
    # no room left in the step)
    num_proposals_skipped: int = 0
    num_verify_rows: int = 0  # rows with drafts whose result was applied
    num_draft_tokens: int = 0  # drafts in those rows
    num_accepted_tokens: int = 0  # of those, accepted by verification
    # [i]: verify rows whose draft at position i was accepted (acceptance per position)
    accepted_per_position: list[int] = field(default_factory=list)
    # [i]: verify rows that had a draft at position i (the denominator of acceptance at i)
    drafted_per_position: list[int] = field(default_factory=list)

    def record_verify(self, num_drafts: int, num_accepted: int) -> None:
        """One verify row's result: `num_accepted` of its `num_drafts` drafts accepted."""
        assert 0 <= num_accepted <= num_drafts
        self.num_verify_rows += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        if len(self.drafted_per_position) < num_drafts:
            self.drafted_per_position += [0] * (num_drafts - len(self.drafted_per_position))
        for i in range(num_drafts):
            self.drafted_per_position[i] += 1

    def acceptance_rate_at(self, i: int) -> float:
        """Of the verify rows with a draft at position i, the share that accepted it (a
        draft is accepted only if every draft before it was)."""
        drafted = self.drafted_per_position[i] if i < len(self.drafted_per_position) else 0
        accepted = self.accepted_per_position[i] if i < len(self.accepted_per_position) else 0
        return accepted / drafted if drafted else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify row produced on average: accepted drafts + the bonus sample."""
        if not self.num_verify_rows:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verify_rows

    @property
    def fire_rate(self) -> float:
        """Share of proposals that drafted anything."""
        return self.num_proposals_with_drafts / self.num_proposals if self.num_proposals else 0.0

    def as_engine_stats(self) -> dict[str, float | list]:
        """The `spec_*` fields of `radixrt.stats.EngineStats` (counters, rates, per position)."""
        return {
            "spec_proposals": self.num_proposals,
            "spec_proposals_with_drafts": self.num_proposals_with_drafts,
            "spec_proposals_skipped": self.num_proposals_skipped,
            "spec_fire_rate": self.fire_rate,
            "spec_verify_rows": self.num_verify_rows,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_acceptance_length": self.mean_acceptance_length,
            "spec_accepted_per_position": list(self.accepted_per_position),
            "spec_acceptance_rate_per_position": [
                self.acceptance_rate_at(i) for i in range(len(self.drafted_per_position))
            ],
        }
