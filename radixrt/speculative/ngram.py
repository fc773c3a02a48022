"""Prompt lookup (n-gram) drafts: find the row's last n tokens earlier in its own sequence
and propose what followed them there."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Longest suffix match of length in [min_n, max_n]; among equally long matches the
    most recent earlier occurrence wins. Vectorised: one [max_n, L] comparison per call."""

    drafts_on_device = False

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int], max_drafts: int, salt: str | None = None) -> list[int]:
        return ngram_lookup(tokens, self.min_n, self.max_n, max_drafts)

    def may_propose_next(self, tokens: Sequence[int], salt: str | None = None) -> bool:
        """Whether `propose(tokens + [t])` drafts for some token t: exactly when the last
        min_n - 1 tokens occur earlier with a token after them (t can be that token); always
        for min_n = 1."""
        m = self.min_n - 1
        if m == 0:
            return len(tokens) > 0
        if m == 1:  # the common case (min_n = 2), without numpy
            return len(tokens) > 1 and tokens[-1] in tokens[:-1]
        return bool(ngram_lookup(tokens, m, m, 1))


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
