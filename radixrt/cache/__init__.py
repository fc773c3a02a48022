"""Prefix caches: radix (token-level tree), blockhash (vLLM APC baseline), none."""

from __future__ import annotations

from radixrt.cache.base import CacheStats, InsertResult, MatchResult, PrefixCache
from radixrt.kv.allocator import BlockAllocator


def create_prefix_cache(
    kind: str,
    allocator: BlockAllocator,
    block_size: int,
    num_host_blocks: int = 0,
    events: object | None = None,
) -> PrefixCache:
    """Build the cache named by `kind` (radix | blockhash | none) over `allocator`, with a
    host KV tier of `num_host_blocks` blocks when > 0 and KV events recorded by `events` (a
    `radixrt.cache.radix_events.RadixEventRecorder`) when given (both radix only: ValueError
    otherwise)."""
    if num_host_blocks and kind != "radix":
        raise ValueError(f"a host KV tier needs prefix_cache 'radix', got {kind!r}")
    if events is not None and kind != "radix":
        raise ValueError(f"KV events need prefix_cache 'radix', got {kind!r}")
    if kind == "radix":
        from radixrt.cache.radix import RadixCache
        from radixrt.cache.tiers import HostTier

        host = HostTier(num_host_blocks) if num_host_blocks else None
        return RadixCache(allocator, block_size, host, events)
    if kind == "blockhash":
        from radixrt.cache.blockhash import BlockHashCache

        return BlockHashCache(allocator, block_size)
    if kind == "none":
        from radixrt.cache.none import NoCache

        return NoCache(block_size)
    raise ValueError(f"prefix_cache must be radix, blockhash or none, got {kind!r}")


__all__ = [
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "PrefixCache",
    "create_prefix_cache",
]
