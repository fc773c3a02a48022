"""Prompt lookup (n-gram) drafts: find the row's last n tokens earlier in its own sequence
and propose what followed them there.

`ngram_lookup` reads a whole sequence (O(context) per call). The scheduler passes the proposer
an `NgramIndex` instead (`NgramProposer.track`, one per request): a view of the request's
append-only token list with a table from each n-gram to its latest end, brought up to date with
the tokens appended since the last call, so that a lookup costs O(max_n) whatever the context
length. Both give the same drafts (tests/test_spec.py checks it on random sequences).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.speculative.base import Proposer


class NgramProposer(Proposer):
    """Longest suffix match of length in [min_n, max_n]; among equally long matches the
    most recent earlier occurrence wins. Vectorised: one [max_n, L] comparison per call."""

    indexes = True

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n = min_n
        self.max_n = max_n

    def track(self, tokens: list[int]) -> NgramIndex:
        """An index over the append-only list `tokens` for `propose` and `may_propose_next`
        (which then cost O(max_n), plus the indexing of tokens appended since the last call)."""
        return NgramIndex(tokens, max(1, self.min_n - 1), self.max_n)

    def propose(
        self, tokens: Sequence[int], max_drafts: int, namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> list[int]:
        if isinstance(tokens, NgramIndex) and tokens.covers(self.min_n, self.max_n):
            return tokens.lookup(self.min_n, self.max_n, max_drafts)
        return ngram_lookup(tokens, self.min_n, self.max_n, max_drafts)

    def may_propose_next(
        self, tokens: Sequence[int], namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> bool:
        """Whether `propose(tokens + [t])` drafts for some token t: exactly when the last
        min_n - 1 tokens occur earlier with a token after them (t can be that token); always
        for min_n = 1."""
        m = self.min_n - 1
        if m == 0:
            return len(tokens) > 0
        if isinstance(tokens, NgramIndex) and tokens.covers(m, m):
            return bool(tokens.lookup(m, m, 1))
        if m == 1:  # the common case (min_n = 2), without numpy
            return len(tokens) > 1 and tokens[-1] in tokens[:-1]
        return bool(ngram_lookup(tokens, m, m, 1))


# tokens a lookup indexes at most (~1.5 ms); with more behind, it reads the whole list
CATCH_UP_MAX = 1024


class NgramIndex(Sequence[int]):
    """A read-only view of an append-only token list (a request's `seq_token_ids`) with the
    latest end of each of its n-grams, lo <= n <= hi, among the ends that a token follows (the
    candidates of `ngram_lookup`). The table catches up with the list on each lookup (by at most
    CATCH_UP_MAX tokens, answering from the whole list meanwhile); a list that got shorter
    (never done to a request's sequence) is indexed afresh."""

    __slots__ = ("tokens", "lo", "hi", "_last", "_done")

    def __init__(self, tokens: list[int], lo: int, hi: int) -> None:
        assert 1 <= lo <= hi
        self.tokens = tokens
        self.lo = lo
        self.hi = hi
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> its latest end j <= done - 2
        self._done = 0  # the list's length when the table was last brought up to date

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):  # type: ignore[override]
        return self.tokens[i]

    def __iter__(self):
        return iter(self.tokens)

    def covers(self, min_n: int, max_n: int) -> bool:
        return self.lo <= min_n and max_n <= self.hi

    def advance(self, upto: int) -> None:
        """Index the list's first `upto` tokens (at most its length) if not done yet: the
        scheduler calls it for prefill chunks, so that decoding starts with the prompt indexed."""
        tokens, last, lo, hi = self.tokens, self._last, self.lo, self.hi
        n_tok = len(tokens)
        if n_tok < self._done:
            last.clear()
            self._done = 0
        n_tok = min(n_tok, upto)
        # ends j = done - 1 .. n_tok - 2 got a token after them since the last call
        for j in range(max(self._done - 1, 0), n_tok - 1):
            gram = tuple(tokens[max(j + 1 - hi, 0) : j + 1])  # the longest n-gram ending at j
            size = len(gram)
            for n in range(lo, size):
                last[gram[size - n :]] = j
            if size >= lo:
                last[gram] = j
        self._done = max(self._done, n_tok)

    def lookup(self, min_n: int, max_n: int, max_drafts: int) -> list[int]:
        """`ngram_lookup(self.tokens, min_n, max_n, max_drafts)`, for lo <= min_n, max_n <= hi."""
        tokens = self.tokens
        n_tok = len(tokens)
        if n_tok <= min_n or max_drafts <= 0:
            return []
        if n_tok != self._done:
            if n_tok - self._done > CATCH_UP_MAX:  # spread a long catch-up over calls
                self.advance(self._done + CATCH_UP_MAX)
                return ngram_lookup(tokens, min_n, max_n, max_drafts)
            self.advance(n_tok)
        last = self._last
        top = min(max_n, n_tok - 1)
        suffix = tuple(tokens[n_tok - top :])
        for n in range(top, min_n - 1, -1):
            j = last.get(suffix[top - n :])
            if j is not None:  # the longest suffix that occurs earlier; its latest end
                return tokens[j + 1 : j + 1 + max_drafts]
        return []

    def check(self) -> None:
        """Assert the table is that of the list's first `done` tokens (O(context))."""
        fresh = NgramIndex(self.tokens[: self._done], self.lo, self.hi)
        fresh.advance(self._done)
        assert fresh._last == self._last, "ngram index out of step with its token list"


def ngram_lookup(tokens: Sequence[int], min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """Up to `max_drafts` tokens that followed the most recent earlier occurrence of the
    longest suffix of `tokens` (length min_n..max_n) that occurs earlier; [] if none."""
    n_tok = len(tokens)
    if n_tok <= min_n or max_drafts <= 0:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    depth = min(max_n, n_tok - 1)
    # Candidate ends j in [0, L - 2] (a token follows each). eq[d, j]: seq[j - d] equals the
    # suffix's token seq[L - 1 - d]; j - d < 0 never matches.
    ends = np.arange(n_tok - 1)
    back = ends[None, :] - np.arange(depth)[:, None]  # [depth, L - 1]
    eq = (back >= 0) & (seq[np.maximum(back, 0)] == seq[n_tok - 1 - np.arange(depth)][:, None])
    match_len = np.cumprod(eq, axis=0).sum(axis=0)  # [L - 1]: suffix match length per end
    best = int(match_len.max())
    if best < min_n:
        return []
    j = int(np.flatnonzero(match_len == best)[-1])  # most recent among the longest
    return list(tokens[j + 1 : j + 1 + max_drafts])
