"""Radix-cache drafts: the continuation the prefix tree already holds after the row's
context (a re-run program, a retried agent step, a regenerated answer)."""

from __future__ import annotations

from collections.abc import Sequence

from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.cache.radix import RadixCache
from radixrt.speculative.base import Proposer


class RadixProposer(Proposer):
    """Reads `RadixCache.peek_continuation` (no split, no LRU refresh, no hit counted)."""

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache

    def propose(
        self, tokens: Sequence[int], max_drafts: int, namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> list[int]:
        return self.cache.peek_continuation(tokens, max_drafts, namespace)

    def may_propose_next(
        self, tokens: Sequence[int], namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> bool:
        """Whether the tree holds two tokens after `tokens` (one for the unknown next token,
        one to draft) along the most recently used path (another branch can make this miss)."""
        return len(self.cache.peek_continuation(tokens, 2, namespace)) == 2
