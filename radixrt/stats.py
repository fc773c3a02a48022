"""`EngineStats`: every counter and gauge the engine reports, declared once.

The scheduler's counters are `SchedulerCounters`, which the scheduler and its parts mutate in
place (`Scheduler.stats`); `EngineStats` inherits them and adds the gauges and the other
components' counters. `EngineCore.stats_struct()` copies the scheduler's struct whole (no line
per field) and fills the rest; the scheduler process sends the result as it is inside each
`SchedulerSnapshot`; `/metrics` exports every field as `radixrt_<field>` (or the name in the
field's `metric`) with the field's description as help text; `EngineCore.stats()` is its dict
view. A new scheduler counter is one field of `SchedulerCounters` (with its description) and a
test of what it counts. Torch-free: the front imports it.
"""

from __future__ import annotations

from typing import Annotated, Any, NamedTuple, get_type_hints

import msgspec
from msgspec import Meta


def _doc(description: str, metric: str | None = None, label: str | None = None) -> Meta:
    """A field's help text, its metric name when it is not the field's own, and for a dict
    field the metric label its keys go under."""
    extra = {k: v for k, v in (("metric", metric), ("label", label)) if v}
    return Meta(description=description, extra=extra or None)


class SchedulerCounters(msgspec.Struct, kw_only=True):
    """The scheduler's counters since start, mutated in place where they count (plain
    attribute increments, as cheap as a dataclass's)."""

    # requests and tokens
    num_requests: Annotated[int, _doc("Requests admitted for the first time, since start")] = 0
    prompt_tokens: Annotated[
        int, _doc("Prompt tokens of admitted requests, since start", "scheduler_prompt_tokens")
    ] = 0
    cached_tokens: Annotated[
        int,
        _doc("Of those, served by the prefix cache, since start", "scheduler_cached_tokens"),
    ] = 0
    generated_tokens: Annotated[
        int, _doc("Tokens generated, since start", "scheduler_generated_tokens")
    ] = 0
    dropped_tokens: Annotated[
        int, _doc("Tokens sampled by an overlapped step after their request finished")
    ] = 0
    prompt_tokens_computed: Annotated[
        int, _doc("Prompt positions fed to the model (recomputes too), since start")
    ] = 0
    preemptions: Annotated[int, _doc("Requests preempted, since start")] = 0
    steps: Annotated[int, _doc("Engine steps, since start")] = 0
    # server faults survived (each a bug)
    failed_requests: Annotated[
        int,
        _doc(
            "Requests the scheduler failed on a host-side exception of their own, since start",
            "scheduler_failed_requests",
        ),
    ] = 0
    failed_steps: Annotated[
        int,
        _doc(
            "Steps whose batched forward raised (their requests failed), since start",
            "scheduler_failed_steps",
        ),
    ] = 0
    # prefix matches inside a block
    cow_copies: Annotated[int, _doc("Partial blocks copied on a mid-block prefix match")] = 0
    inplace_appends: Annotated[
        int, _doc("Mid-block prefix matches that wrote on in the cached block")
    ] = 0
    # n > 1 forks and beam search (radixrt.scheduler.groups)
    forks: Annotated[int, _doc("Request groups (n > 1, beam search) forked, since start")] = 0
    fork_shared_blocks: Annotated[int, _doc("Full prompt blocks shared by reference at forks")] = 0
    fork_copied_blocks: Annotated[int, _doc("Partial prompt blocks copied at forks")] = 0
    beam_steps: Annotated[int, _doc("Beam-search selection steps, since start")] = 0
    beam_shared_blocks: Annotated[int, _doc("Full blocks shared by re-parented beams")] = 0
    beam_copied_blocks: Annotated[int, _doc("Partial blocks copied for re-parented beams")] = 0
    # structured output (radixrt.scheduler.grammar)
    grammar_requests: Annotated[int, _doc("Constrained requests whose grammar compiled")] = 0
    grammar_errors: Annotated[
        int, _doc("Constrained requests refused (compile error or timeout)")
    ] = 0
    grammar_forced_tokens: Annotated[
        int, _doc("Tokens appended by jump-forward (also generated)")
    ] = 0
    # retention hints (cache_ttl_s; radixrt.scheduler.retention)
    retention_holds: Annotated[
        int, _doc("Finished contexts held cached (cache_ttl_s), since start")
    ] = 0
    retention_expired: Annotated[int, _doc("Retention holds ended by their time to live")] = 0
    retention_released: Annotated[int, _doc("Retention holds given up for room")] = 0
    retention_refused: Annotated[
        int, _doc("Retention holds not taken: older holds fill the share bound")
    ] = 0
    # host KV tier (zero without one)
    host_hit_tokens: Annotated[
        int, _doc("Prompt tokens loaded from the host KV tier, since start")
    ] = 0
    host_deferred_loads: Annotated[
        int, _doc("Admissions whose first row waited a step for host loads")
    ] = 0
    # LoRA adapters (radixrt.scheduler.lora), by adapter name (label `lora`); each update
    # replaces the dict, so a struct copied out of the scheduler does not change after
    lora_requests: Annotated[
        dict[str, int], _doc("Requests finished under the LoRA adapter, since start", None, "lora")
    ] = {}
    lora_prompt_tokens: Annotated[
        dict[str, int], _doc("Prompt tokens of those requests, since start", None, "lora")
    ] = {}
    lora_generated_tokens: Annotated[
        dict[str, int], _doc("Tokens generated for those requests, since start", None, "lora")
    ] = {}


class EngineStats(SchedulerCounters, kw_only=True):
    """Counters since start (totals) and gauges (state after the latest step): the
    scheduler's counters (inherited) and the fields below."""

    # requests and tokens
    running: Annotated[int, _doc("Requests running in the scheduler", "num_requests_running")] = 0
    waiting: Annotated[int, _doc("Requests waiting in the scheduler", "num_requests_waiting")] = 0
    cache_hit_rate: Annotated[
        float, _doc("Cached / prompt tokens of admitted requests since start")
    ] = 0.0
    # the device KV pool and the prefix cache
    kv_blocks_total: Annotated[int, _doc("KV blocks in the pool")] = 0
    kv_tokens_total: Annotated[int, _doc("KV tokens in the pool (blocks * block size)")] = 0
    kv_fp8: Annotated[float, _doc("1 when the KV pool stores fp8_e4m3")] = 0.0
    kv_blocks_free: Annotated[int, _doc("KV blocks nobody holds")] = 0
    kv_blocks_cached: Annotated[int, _doc("KV blocks the prefix cache holds")] = 0
    kv_blocks_in_use: Annotated[
        int, _doc("KV blocks held by requests or locked cache paths (not free, not evictable)")
    ] = 0
    evicted_blocks: Annotated[int, _doc("KV blocks freed by prefix-cache eviction")] = 0
    # structured output: the grammar backend's cache and compiles (radixrt.grammar.base)
    grammar_cache_hits: Annotated[int, _doc("Constrained requests whose grammar was cached")] = 0
    grammar_cache_misses: Annotated[
        int, _doc("Constrained requests that started a grammar compile")
    ] = 0
    grammar_cache_evictions: Annotated[
        int, _doc("Compiled grammars dropped to bound the cache")
    ] = 0
    grammar_cache_bytes: Annotated[int, _doc("Bytes the grammar cache holds")] = 0
    grammar_compile_timeouts: Annotated[int, _doc("Grammar compiles stopped at the time limit")] = 0
    grammar_compile_preemptions: Annotated[
        int, _doc("Grammar compiles stopped for a waiting one")
    ] = 0
    grammar_compiler_failed: Annotated[
        int, _doc("1 once the grammar compiler could not start or died (grammars get 503)")
    ] = 0
    # retention hints (radixrt.scheduler.retention)
    retention_held_blocks: Annotated[int, _doc("Distinct KV blocks retention holds keep now")] = 0
    # speculative decoding (zero without a proposer)
    spec_proposals: Annotated[int, _doc("Decode rows the proposer was asked to draft for")] = 0
    spec_proposals_with_drafts: Annotated[
        int, _doc("Of those, rows it drafted at least one token for")
    ] = 0
    spec_proposals_skipped: Annotated[
        int,
        _doc("Of those, rows whose step did not verify their drafts (too few expected accepted)"),
    ] = 0
    spec_fire_rate: Annotated[float, _doc("Proposals with drafts / proposals")] = 0.0
    spec_verify_rows: Annotated[int, _doc("Rows that verified speculative drafts, since start")] = 0
    spec_draft_tokens: Annotated[int, _doc("Speculative draft tokens verified, since start")] = 0
    spec_accepted_tokens: Annotated[int, _doc("Speculative draft tokens accepted, since start")] = 0
    spec_acceptance_rate: Annotated[float, _doc("Accepted / verified draft tokens")] = 0.0
    spec_mean_acceptance_length: Annotated[
        float, _doc("Mean tokens per verify row (accepted + 1)")
    ] = 0.0
    # [i]: verify rows whose draft i was accepted; dict view: spec_accepted_pos_<i>
    spec_accepted_per_position: Annotated[
        list[int], _doc("Verify rows whose draft at this position was accepted")
    ] = []
    # [i]: that over the rows that had a draft i; dict view: spec_acceptance_rate_pos_<i>
    spec_acceptance_rate_per_position: Annotated[
        list[float], _doc("Acceptance rate of drafts at this position")
    ] = []
    # host KV tier: the cache's and the runner's (zero without one; radixrt.engine.tier_stats)
    host_written_back_blocks: Annotated[
        int, _doc("KV blocks written back to the host, since start")
    ] = 0
    host_loaded_blocks: Annotated[int, _doc("KV blocks loaded from the host, since start")] = 0
    host_evicted_blocks: Annotated[
        int, _doc("Host KV blocks freed by host LRU eviction, since start")
    ] = 0
    host_dropped_blocks: Annotated[
        int, _doc("KV blocks evicted without a host copy (the host was full)")
    ] = 0
    host_kv_blocks_total: Annotated[int, _doc("KV blocks in the host pool")] = 0
    host_kv_blocks_free: Annotated[int, _doc("Host KV blocks nobody holds")] = 0
    host_kv_blocks_cached: Annotated[int, _doc("Host KV blocks the prefix cache holds")] = 0
    swap_out_bytes: Annotated[
        int, _doc("Bytes copied device -> host by write-backs, since start")
    ] = 0
    swap_in_bytes: Annotated[int, _doc("Bytes copied host -> device by loads, since start")] = 0
    swap_seconds: Annotated[float, _doc("Seconds of host <-> device KV transfers, since start")] = (
        0.0
    )
    # storage KV tier (zero without one; radixrt.engine.tier_stats)
    storage_hits: Annotated[int, _doc("KV pages read back from storage, since start")] = 0
    storage_misses: Annotated[
        int, _doc("KV pages storage did not have, or had unreadable, when read, since start")
    ] = 0
    storage_corrupt_pages: Annotated[
        int, _doc("Of the misses, pages found torn, corrupt or foreign (deleted)")
    ] = 0
    storage_read_bytes: Annotated[int, _doc("Bytes of KV pages read from storage")] = 0
    storage_written_bytes: Annotated[int, _doc("Bytes of KV pages written to storage")] = 0
    storage_written_pages: Annotated[int, _doc("KV pages written to storage, since start")] = 0
    storage_write_drops: Annotated[
        int, _doc("KV pages not written: every staging page was busy, since start")
    ] = 0
    storage_written_back_pages: Annotated[
        int,
        _doc("KV pages leaving the host tier written to storage (their write-through had not)"),
    ] = 0
    storage_errors: Annotated[int, _doc("Storage reads and page writes that failed")] = 0
    storage_pages: Annotated[int, _doc("KV pages in storage (as far as this process knows)")] = 0
    storage_bytes: Annotated[int, _doc("Bytes of those pages")] = 0
    storage_evicted_pages: Annotated[
        int, _doc("KV pages deleted to keep storage within its size bound")
    ] = 0
    storage_fetches: Annotated[
        int, _doc("Fetches of prompt pages a request missed in GPU and host memory")
    ] = 0
    storage_fetched_pages: Annotated[int, _doc("KV pages those fetches found")] = 0
    storage_adopted_pages: Annotated[
        int, _doc("Of those, pages that entered the cache (others were cached by then)")
    ] = 0
    storage_prefetch_waits: Annotated[int, _doc("Requests that waited for a fetch")] = 0
    storage_prefetch_timeouts: Annotated[
        int, _doc("Of those, requests admitted before their fetch ended")
    ] = 0
    storage_prefetch_wait_seconds: Annotated[
        float, _doc("Seconds requests waited for fetches, since start")
    ] = 0.0
    storage_loads_chosen: Annotated[
        int, _doc("Prefixes missing GPU and host memory that the load policy read from storage")
    ] = 0
    storage_recomputes_chosen: Annotated[
        int, _doc("Prefixes in reach of storage that the cost model left to prefill instead")
    ] = 0
    storage_probe_fetches: Annotated[
        int, _doc("Of those, prefixes fetched anyway (nobody waiting) to measure storage")
    ] = 0
    storage_read_bandwidth_bytes_per_second: Annotated[
        float, _doc("The cost model's storage read bandwidth (a conservative seed until timed)")
    ] = 0.0
    storage_fetch_latency_seconds: Annotated[
        float, _doc("The cost model's per-fetch latency (a seed until timed)")
    ] = 0.0
    storage_prefill_tokens_per_second: Annotated[
        float, _doc("The cost model's prefill throughput (0 until a prefill step is timed)")
    ] = 0.0

    def as_dict(self) -> dict[str, float]:
        """The flat view (`EngineCore.stats()`): each scalar field under its name, the
        per-position lists as `spec_accepted_pos_<i>` / `spec_acceptance_rate_pos_<i>`, and
        the per-adapter dicts as `lora_requests:<name>` and so on."""
        out: dict[str, Any] = {}
        for f in STAT_FIELDS:
            value = getattr(self, f.name)
            if f.per_position:
                prefix = f.name.removesuffix("_per_position")
                out.update({f"{prefix}_pos_{i}": v for i, v in enumerate(value)})
            elif f.label is not None:
                out.update({f"{f.name}:{key}": v for key, v in value.items()})
            else:
                out[f.name] = value
        return out


class StatField(NamedTuple):
    name: str  # the EngineStats field
    metric: str  # the exported name: radixrt_<metric>
    description: str  # help text
    # the metric's label: "position" for a list (one value per draft position), the field's
    # declared label for a dict (one value per key, e.g. "lora"), None for a scalar
    label: str | None

    @property
    def per_position(self) -> bool:
        return self.label == "position"

    def labelled(self, value: Any) -> list[tuple[str, float]]:
        """(label value, value) of a labelled field's value (a list or a dict)."""
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return [(str(k), v) for k, v in items]


def _stat_fields() -> tuple[StatField, ...]:
    """EngineStats' fields in declaration order (the scheduler's counters first). A field
    declared without `_doc` metadata gets an empty description (tests refuse it)."""
    hints = get_type_hints(EngineStats, include_extras=True)
    out = []
    for name in EngineStats.__struct_fields__:
        metas = [m for m in getattr(hints[name], "__metadata__", ()) if isinstance(m, Meta)]
        meta = metas[0] if metas else Meta()
        metric = (meta.extra or {}).get("metric", name)
        label = "position" if name.endswith("_per_position") else (meta.extra or {}).get("label")
        out.append(StatField(name, metric, meta.description or "", label))
    return tuple(out)


STAT_FIELDS = _stat_fields()


class CachePressure(msgspec.Struct, frozen=True, kw_only=True):
    """How full the KV pool is with retention holds, after the latest step
    (`EngineCore.cache_pressure()`): what a client that runs many multi-call programs reads to
    decide whether to start another one or to let a program go on whose context is not held
    (`radixrt.frontend`'s run_batch admission). Plain data, taken between steps."""

    num_blocks: int  # the device pool
    block_size: int  # tokens per block
    # None in a tenant's view (`EngineCore.cache_pressure(salts)`): they show others' use
    free_blocks: int | None  # unallocated
    evictable_blocks: int | None  # cached, unlocked: taken back on demand
    held_blocks: int  # distinct blocks retention holds keep (`retention_held_blocks`)
    max_held_blocks: int  # the share bound on them (`retention_max_share` x the pool)
    holds_refused: int | None  # holds not taken for want of room, since start
    held: frozenset[str] = frozenset()  # finished requests whose holds are in place

    @property
    def room_blocks(self) -> int:
        """Blocks another hold may add before the share bound."""
        return max(0, self.max_held_blocks - self.held_blocks)
