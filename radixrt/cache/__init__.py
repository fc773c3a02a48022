"""Prefix caches: radix (token-level tree, with an optional host-tier layer), blockhash (vLLM APC
baseline), none; and the namespace every cache key derives from."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixrt.cache.base import CacheStats, InsertResult, MatchResult, PrefixCache
from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.kv.allocator import BlockAllocator

if TYPE_CHECKING:
    from radixrt.cache.radix_events import RadixEventRecorder
    from radixrt.cache.storage import StorageTier


def create_prefix_cache(
    kind: str,
    allocator: BlockAllocator,
    block_size: int,
    num_host_blocks: int = 0,
    events: RadixEventRecorder | None = None,
    storage: StorageTier | None = None,
) -> PrefixCache:
    """Build the cache named by `kind` (radix | blockhash | none) over `allocator`: for radix,
    the base tree, or its host-tier layer with `num_host_blocks` host blocks when > 0, which
    report to `events` (a `radixrt.cache.radix_events.RadixEventRecorder`) when given. A host
    tier or events with another kind: ValueError. `storage` (a storage tier under the host
    tier) makes it the storage layer of the host tier's tree (whose pages get events on the
    storage's medium with `events`)."""
    if num_host_blocks and kind != "radix":
        raise ValueError(f"a host KV tier needs prefix_cache 'radix', got {kind!r}")
    if events is not None and kind != "radix":
        raise ValueError(f"KV events need prefix_cache 'radix', got {kind!r}")
    if storage is not None and not (kind == "radix" and num_host_blocks):
        raise ValueError("a storage KV tier needs prefix_cache 'radix' and a host tier")
    if storage is not None:
        from radixrt.cache.radix_storage import StorageRadixCache
        from radixrt.cache.storage_events import StorageEventRecorder
        from radixrt.cache.tiers import HostTier

        storage_events = None
        if events is not None:  # a step's ops name at most every device and host block
            max_pending = allocator.num_blocks + num_host_blocks
            storage_events = StorageEventRecorder(events, storage.medium, max_pending)
        host = HostTier(num_host_blocks)
        return StorageRadixCache(allocator, block_size, host, storage, events, storage_events)
    if kind == "radix" and num_host_blocks:
        from radixrt.cache.radix_host import HostRadixCache
        from radixrt.cache.tiers import HostTier

        return HostRadixCache(allocator, block_size, HostTier(num_host_blocks), events)
    if kind == "radix":
        from radixrt.cache.radix import RadixCache

        return RadixCache(allocator, block_size, events)
    if kind == "blockhash":
        from radixrt.cache.blockhash import BlockHashCache

        return BlockHashCache(allocator, block_size)
    if kind == "none":
        from radixrt.cache.none import NoCache

        return NoCache(block_size)
    raise ValueError(f"prefix_cache must be radix, blockhash or none, got {kind!r}")


__all__ = [
    "DEFAULT_NAMESPACE",
    "CacheNamespace",
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "PrefixCache",
    "create_prefix_cache",
]
