"""Speculative decoding proposers: ngram (prompt lookup), radix (the prefix cache's own
continuation), draft (a draft model that the runner runs, `radixrt.executor.draft`).
`create_proposer` imports lazily (the ngram proposer needs numpy)."""

from __future__ import annotations

from radixrt.cache.base import PrefixCache
from radixrt.config import SpeculativeConfig
from radixrt.speculative.base import Proposer, SpecStats


def create_proposer(cfg: SpeculativeConfig, cache: PrefixCache) -> Proposer | None:
    """The proposer `cfg` names over `cache`, or None for speculative_method 'none'.
    Raises ValueError for 'radix' over a cache that is not a RadixCache."""
    method = cfg.speculative_method
    if method == "none":
        return None
    if method == "ngram":
        from radixrt.speculative.ngram import NgramProposer

        return NgramProposer(cfg.ngram_min_n, cfg.ngram_max_n)
    if method == "radix":
        from radixrt.cache.radix import RadixCache
        from radixrt.speculative.radix import RadixProposer

        if not isinstance(cache, RadixCache):
            raise ValueError(
                f"speculative_method 'radix' needs the radix prefix cache, got "
                f"{type(cache).__name__}; use prefix_cache='radix' or speculative_method 'ngram'"
            )
        return RadixProposer(cache)
    if method == "draft":
        from radixrt.speculative.draft import DraftModelProposer

        return DraftModelProposer()
    raise ValueError(f"unknown speculative_method {method!r}; allowed: none, ngram, radix, draft")


__all__ = ["Proposer", "SpecStats", "create_proposer"]
