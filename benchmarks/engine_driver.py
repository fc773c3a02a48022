"""Drive an in-process `Engine` through a workload: add the ready calls, step, repeat.

Token level (`engine.core`): no detokenizer in the loop, like the server's scheduler
process. Times are taken after each step, so a token's time is the end of its step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from benchmarks.dispatch import Dispatcher, ReadyCall
from benchmarks.metrics import CallRecord, DriverResult, KVStats
from benchmarks.workloads import Workload
from radixrt.engine import Engine
from radixrt.engine.core import EngineCore
from radixrt.sampling import DEFAULT_OPTIONS, RequestOptions, SamplingParams

HOST_COUNTERS = (
    "prompt_tokens_computed",
    "host_hit_tokens",
    "host_written_back_blocks",
    "host_loaded_blocks",
)  # engine stats differenced per run (see KVStats)


def run_engine(
    engine: Engine | EngineCore,
    workload: Workload,
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    timeout_s: float | None = None,
    on_call_done: Callable[[], None] | None = None,
    cache_ttl_s: float = 0.0,
    holds: Sequence[bool] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> DriverResult:
    """Run every call of `workload` on `engine` (which must be idle) and time it.

    After the run (or the timeout, which aborts what is left) the engine is idle: its
    integrity check passes and only the prefix cache holds blocks; the cache is kept.
    `on_call_done` is called once per finished call (progress bars). `cache_ttl_s`: every
    call that a later call of its program extends asks that its context stay cached this
    long (a retention hint; a program's last calls ask nothing); a program's holds are
    released when its last call finishes (as the DSL does at a program's end), any left at
    the end of the run; `holds`: per program, whether it asks for them (None: every program;
    the others stand for traffic that holds nothing). `clock` / `sleep`: the time source (a
    simulation passes a virtual one)."""
    core = getattr(engine, "core", engine)  # an Engine, or an EngineCore (simulations)
    alloc, cache = core.allocator, core.cache
    assert not core.has_work, "run_engine needs an idle engine"
    params = {
        n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        for n in {c.max_tokens for p in workload.programs for c in p.calls}
    }
    held_options = RequestOptions(cache_ttl_s=cache_ttl_s)
    has_children = [
        [bool(k) and (holds is None or holds[i]) for k in p.children()]
        for i, p in enumerate(workload.programs)
    ]
    disp = Dispatcher(workload, max_concurrency, request_rate, seed)
    before = engine.stats()
    inflight: dict[str, tuple[ReadyCall, CallRecord]] = {}
    held: dict[int, list[str]] = {}  # program -> its calls that asked for a hold
    calls_left = [len(p.calls) for p in workload.programs]
    records: list[CallRecord] = []
    outputs: dict[str, list[int]] = {}  # rid -> output token ids so far
    peak_used = peak_active = alloc.num_used
    complete = True
    start = clock()
    while not disp.done:
        now = clock() - start
        if timeout_s is not None and now > timeout_s:
            complete = False
            break
        for call in disp.pop_ready(now):
            ttl = cache_ttl_s if has_children[call.program][call.index] else 0.0
            options = held_options if ttl > 0 else DEFAULT_OPTIONS
            rid = core.add_request(call.prompt, params[call.max_tokens], options=options)
            if ttl > 0:
                held.setdefault(call.program, []).append(rid)
            record = CallRecord(len(call.prompt), 0, 0, now, now, now, program=call.program)
            inflight[rid] = (call, record)
        if not core.has_work:  # every program left waits for its arrival time
            nxt = disp.next_arrival()
            assert nxt is not None, "nothing running, nothing ready, programs left"
            sleep(max(0.0, nxt - now))
            continue
        changed = core.step()
        t = clock() - start
        used = alloc.num_used
        peak_used = max(peak_used, used)
        peak_active = max(peak_active, used - cache.evictable_blocks)
        for d in changed:
            call, rec = inflight[d.rid]
            rec.token_times += [t] * len(d.new_token_ids)
            outputs.setdefault(d.rid, []).extend(d.new_token_ids)
            if d.finished:
                del inflight[d.rid]
                rec.cached_tokens = d.num_cached_tokens
                rec.output_tokens = d.num_output_tokens
                rec.first_token = rec.token_times[0] if rec.token_times else t
                rec.end = t
                records.append(rec)
                disp.finish(call, outputs.pop(d.rid), t)
                calls_left[call.program] -= 1
                if calls_left[call.program] == 0:  # the program ended: its holds go
                    for rid in held.pop(call.program, []):
                        core.release_cache_hold(rid)
                if on_call_done is not None:
                    on_call_done()
    duration = clock() - start
    for rid in list(inflight):
        core.abort(rid)
    while core.has_work:  # a step still in flight
        core.step()
    for rid in list(core.scheduler.retention.holds):
        core.scheduler.retention.release(rid)
    engine.check_integrity()
    assert alloc.num_used == cache.cached_blocks, "a finished run left blocks held by requests"
    after = engine.stats()
    kv = KVStats(
        blocks_total=alloc.num_blocks,
        peak_blocks_used=peak_used,
        peak_blocks_active=peak_active,
        evicted_blocks=int(after["evicted_blocks"] - before["evicted_blocks"]),
        preemptions=int(after["preemptions"] - before["preemptions"]),
        steps=int(after["steps"] - before["steps"]),
        **{k: int(after[k] - before[k]) for k in HOST_COUNTERS},
        swap_bytes=int(sum(after[k] - before[k] for k in ("swap_in_bytes", "swap_out_bytes"))),
        swap_seconds=after["swap_seconds"] - before["swap_seconds"],
    )
    return DriverResult(records, duration, kv, complete)
