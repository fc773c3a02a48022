"""EngineStats is the one definition of the engine's counters: the snapshot carries it as it
is, /metrics exports every field (help text from its description), `EngineCore.stats()` is
its flat view, and the counters count what their descriptions say."""

from __future__ import annotations

import math
from typing import get_type_hints

import msgspec
from prometheus_client.parser import text_string_to_metric_families
from test_fork_beam_scheduler import content_core, drive

from radixrt.sampling import SamplingParams
from radixrt.server.channel import MsgpackCodec
from radixrt.server.messages import FromScheduler, SchedulerSnapshot, TokenBatchOut
from radixrt.server.metrics import ServerMetrics
from radixrt.stats import STAT_FIELDS, EngineStats, SchedulerCounters


def distinct_stats() -> EngineStats:
    """Every scalar field a value of its own (1, 2, ...), the lists two positions each, the
    dicts two keys each."""
    values = {}
    for i, f in enumerate(STAT_FIELDS, start=1):
        if f.label is None:
            values[f.name] = i
        else:
            values[f.name] = [i, i + 1] if f.per_position else {"a": i, "b": i + 1}
    return EngineStats(**values)


def families(metrics: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_every_field_is_on_metrics_with_its_value_and_help():
    stats = distinct_stats()
    metrics = ServerMetrics()
    metrics.update(SchedulerSnapshot(stats))
    exported = families(metrics)
    for f in STAT_FIELDS:
        family = exported[f"radixrt_{f.metric}"]
        assert family.type == "gauge" and family.documentation == f.description, f.name
        samples = {s.labels.get(f.label): s.value for s in family.samples}
        if f.label:
            assert samples == dict(f.labelled(getattr(stats, f.name))), f.name
        else:
            assert samples == {None: getattr(stats, f.name)}, f.name
    metrics.scheduler_gone()
    exported = families(metrics)
    for f in STAT_FIELDS:
        values = [s.value for s in exported[f"radixrt_{f.metric}"].samples]
        if f.label:
            assert values == [], f.name
        else:
            assert len(values) == 1 and math.isnan(values[0]), f.name


def test_every_declared_field_has_metadata_and_is_rendered():
    """Each field as declared (not through STAT_FIELDS) carries a description and is rendered
    on /metrics with it as help text: a new field without `_doc` metadata fails here."""
    hints = get_type_hints(EngineStats, include_extras=True)
    rendered = ServerMetrics()
    rendered.update(SchedulerSnapshot(distinct_stats()))
    text = rendered.render().decode()
    for name in EngineStats.__struct_fields__:
        metas = [m for m in getattr(hints[name], "__metadata__", ()) if isinstance(m, msgspec.Meta)]
        assert metas and metas[0].description, f"{name} has no description"
        metric = (metas[0].extra or {}).get("metric", name)
        assert f"# HELP radixrt_{metric} {metas[0].description}\n" in text, name
        assert f"\nradixrt_{metric}" in text, name


def test_every_scheduler_counter_reaches_stats_by_its_name():
    """The scheduler's counters are EngineStats fields and stats_struct carries each as it
    is: a new counter is one field of SchedulerCounters, nothing else to wire."""
    assert set(SchedulerCounters.__struct_fields__) <= set(EngineStats.__struct_fields__)
    core, _ = content_core(overlap=False)
    live = core.scheduler.stats
    assert type(live) is SchedulerCounters
    labels = {f.name: f.label for f in STAT_FIELDS}
    for i, name in enumerate(SchedulerCounters.__struct_fields__, start=1):
        setattr(live, name, {"a": 1000 + i} if labels[name] else 1000 + i)
    s, view = core.stats_struct(), core.stats()
    for i, name in enumerate(SchedulerCounters.__struct_fields__, start=1):
        if labels[name]:  # a dict by label value
            assert getattr(s, name) == {"a": 1000 + i} and view[f"{name}:a"] == 1000 + i, name
        else:
            assert getattr(s, name) == view[name] == 1000 + i, name


# the scheduler gauges /metrics exported before EngineStats (dashboards read them)
EXPORTED_BEFORE = [
    "num_requests_running",
    "num_requests_waiting",
    "cache_hit_rate",
    "kv_blocks_total",
    "kv_blocks_free",
    "kv_blocks_cached",
    "kv_blocks_in_use",
    "scheduler_failed_requests",
    "scheduler_failed_steps",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_verify_rows",
    "forks",
    "fork_shared_blocks",
    "fork_copied_blocks",
    "beam_steps",
    "beam_shared_blocks",
    "beam_copied_blocks",
    "host_hit_tokens",
    "host_written_back_blocks",
    "host_loaded_blocks",
    "host_evicted_blocks",
    "host_kv_blocks_total",
    "host_kv_blocks_free",
    "host_kv_blocks_cached",
    "swap_out_bytes",
    "swap_in_bytes",
    "swap_seconds",
    "grammar_cache_hits",
    "grammar_cache_misses",
    "grammar_cache_evictions",
    "grammar_cache_bytes",
    "grammar_compile_timeouts",
    "grammar_compile_preemptions",
    "retention_holds",
    "retention_expired",
    "retention_released",
    "retention_held_blocks",
]


def test_metric_names_are_stable():
    """Every gauge exported before is still exported, under the same name; names are unique
    and every field has help text."""
    metrics = {f.metric for f in STAT_FIELDS}
    assert set(EXPORTED_BEFORE) <= metrics
    assert len(metrics) == len(STAT_FIELDS)
    assert all(f.description for f in STAT_FIELDS)


def test_snapshot_carries_the_struct_through_the_codec():
    stats = distinct_stats()
    codec = MsgpackCodec(FromScheduler)
    msg = codec.decode(codec.encode(TokenBatchOut([], [], SchedulerSnapshot(stats, "oops"))))
    assert msg.snapshot == SchedulerSnapshot(stats, "oops")


def test_dict_view_flattens_the_struct():
    stats = EngineStats(prompt_tokens=7, spec_accepted_per_position=[3, 1],
                        spec_acceptance_rate_per_position=[0.75, 0.25])  # fmt: skip
    view = stats.as_dict()
    assert view["prompt_tokens"] == 7
    assert view["spec_accepted_pos_0"] == 3 and view["spec_accepted_pos_1"] == 1
    assert view["spec_acceptance_rate_pos_1"] == 0.25
    scalars = {f.name for f in STAT_FIELDS if not f.label}
    assert scalars <= set(view) and len(view) == len(scalars) + 4
    assert msgspec.structs.asdict(stats)["prompt_tokens"] == 7


def test_counters_count_what_they_say():
    """Token and request counters after a known workload on the scripted runner."""
    core, _ = content_core(overlap=False)
    prompts = [list(range(100, 109)), list(range(100, 109)) + [5, 6]]
    for i, prompt in enumerate(prompts):
        core.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), rid=f"r{i}")
        drive(core)
    s = core.stats_struct()
    assert s.num_requests == 2
    assert s.prompt_tokens == sum(map(len, prompts))
    assert s.generated_tokens == 2 * 4
    # the second prompt matches the first to the token: mid-block, so one partial block is
    # copied or written on in place
    assert s.cached_tokens == len(prompts[0]) and len(prompts[0]) % core.config.cache.block_size
    assert s.cow_copies + s.inplace_appends == 1
    assert s.cache_hit_rate == s.cached_tokens / s.prompt_tokens
    assert s.prompt_tokens_computed == s.prompt_tokens - s.cached_tokens
    assert s.running == s.waiting == s.kv_blocks_in_use == 0
    assert s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total == core.allocator.num_blocks
    assert s.failed_requests == s.failed_steps == s.preemptions == 0
    assert core.stats() == s.as_dict()
