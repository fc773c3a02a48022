"""No prefix caching: every request computes its whole prompt."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from radixrt.cache.base import CacheStats, InsertResult, MatchResult
from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace

if TYPE_CHECKING:
    from radixrt.cache.tiers import KVTier


class NoCache:
    mode = "none"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.stats = CacheStats()
        self.version = 0  # nothing is ever removed
        self.host: KVTier | None = None  # no host KV tier

    def match(
        self, tokens: Sequence[int], namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> MatchResult:
        return MatchResult([], 0, None)

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def insert(
        self,
        tokens: Sequence[int],
        blocks: Sequence[int],
        namespace: CacheNamespace = DEFAULT_NAMESPACE,
        priority: int = 0,
    ) -> InsertResult:
        return InsertResult(None, 0)

    def locked_blocks(self, handle: Any) -> list[int]:
        return []

    def prefix_boundaries(self, handle: Any) -> list[int]:
        return []

    def evict(self, num_blocks: int) -> int:
        return 0

    @property
    def evictable_blocks(self) -> int:
        return 0

    @property
    def cached_blocks(self) -> int:
        return 0

    @property
    def host_cached_blocks(self) -> int:
        return 0

    def held_refs(self) -> Counter[int]:
        return Counter()

    def check_integrity(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def flush_salts(self, salts: Callable[[str | None], bool]) -> int:
        return 0
