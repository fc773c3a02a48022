"""Host KV tier fields of `EngineStats` (all zero without a host tier)."""

from __future__ import annotations

from radixrt.cache.base import PrefixCache
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
