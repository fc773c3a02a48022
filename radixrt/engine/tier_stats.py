"""Host and storage KV tier fields of `EngineStats` (all zero without the tier)."""

from __future__ import annotations

from radixrt.cache.base import PrefixCache
from radixrt.cache.radix_storage import StorageRadixCache
from radixrt.cache.storage import StorageRunner
from radixrt.plan import Runner


def host_tier_stats(cache: PrefixCache, runner: Runner) -> dict[str, float]:
    """The cache's and the runner's host-tier fields of EngineStats (the scheduler counts
    `host_hit_tokens` and `host_deferred_loads` itself): blocks written back / loaded (swap ops of
    plans that did not fail) / evicted from the host / dropped without a host copy (the host was
    full); host pool usage; and, from a runner with a host pool, bytes and seconds of the transfers
    it executed (`Runner.swap_stats`: a failed step's too, if it got that far; `swap_seconds`:
    copy-stream time on CUDA, wall time on a CPU)."""
    host = cache.host
    out: dict[str, float] = {
        "host_written_back_blocks": 0,
        "host_loaded_blocks": 0,
        "host_evicted_blocks": 0,
        "host_dropped_blocks": 0,
        "host_kv_blocks_total": 0,
        "host_kv_blocks_free": 0,
        "host_kv_blocks_cached": 0,
        "swap_out_bytes": 0,
        "swap_in_bytes": 0,
        "swap_seconds": 0.0,
    }
    if host is not None:
        t = host.stats
        out.update(
            host_written_back_blocks=t.num_written_back_blocks,
            host_loaded_blocks=t.num_loaded_blocks,
            host_evicted_blocks=t.num_host_evicted_blocks,
            host_dropped_blocks=t.num_dropped_blocks,
            host_kv_blocks_total=host.allocator.num_blocks,
            host_kv_blocks_free=host.allocator.num_free,
            host_kv_blocks_cached=cache.host_cached_blocks,
        )
    s = runner.swap_stats()
    out.update(swap_out_bytes=s.bytes_out, swap_in_bytes=s.bytes_in, swap_seconds=s.seconds)
    return out


def storage_tier_stats(cache: PrefixCache, runner: StorageRunner) -> dict[str, float]:
    """The storage tier's fields of EngineStats: the scheduler side's (fetches, prefetch
    waits, load-or-recompute decisions and rates) and, from a runner with a storage tier, its
    writes and its backend's counters."""
    if not isinstance(cache, StorageRadixCache):
        return {}
    t, cost = cache.storage.stats, cache.storage.cost
    out: dict[str, float] = dict(
        storage_fetches=t.fetches,
        storage_fetched_pages=t.pages_fetched,
        storage_adopted_pages=t.pages_adopted,
        storage_prefetch_waits=t.prefetch_waits,
        storage_prefetch_timeouts=t.prefetch_timeouts,
        storage_prefetch_wait_seconds=t.prefetch_wait_s,
        storage_loads_chosen=t.loads_chosen,
        storage_recomputes_chosen=t.recomputes_chosen,
        storage_probe_fetches=t.probe_fetches,
        storage_read_bandwidth_bytes_per_second=cost.read_bandwidth.value,
        storage_fetch_latency_seconds=cost.fetch_latency.value,
        storage_prefill_tokens_per_second=cost.prefill_throughput.value or 0.0,
    )
    io = runner.storage_stats()
    b = io.backend
    if b is not None:
        out.update(
            storage_write_drops=io.write_drops,
            storage_written_back_pages=io.pages_written_back,
            storage_errors=io.write_errors + io.fetch_errors,
            storage_hits=b.hits,
            storage_misses=b.misses,
            storage_corrupt_pages=b.corrupt,
            storage_read_bytes=b.bytes_read,
            storage_written_bytes=b.bytes_written,
            storage_written_pages=b.pages_written,
            storage_pages=b.num_pages,
            storage_bytes=b.num_bytes,
            storage_evicted_pages=b.pages_evicted,
        )
    return out
