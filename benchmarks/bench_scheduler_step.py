"""Host time of one engine step with the model stubbed out: `EngineCore.step()` (schedule,
the scripted runner, update, deltas) at batch sizes B on pure-decode steps, overlap on. What
it measures is the scheduler's own cost per step, which a GPU step hides only while it is
shorter than the device's. Only radixrt's public modules are imported, so the same file
times another checkout (`PYTHONPATH=... python benchmarks/bench_scheduler_step.py`).

    python -m benchmarks.bench_scheduler_step --batch 1,32,256 --cases plain,penalties,ngram

`--kv-events on` records KV events and publishes each step's batch on a loopback ZMQ PUB socket
(as `radixrt serve --kv-events-endpoint` does), timed with the step; `--kv-events both` times
a core without and one with events, their steps interleaved.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import replace

from radixrt.config import EngineConfig, SchedulerConfig
from radixrt.engine.core import EngineCore
from radixrt.sampling import SamplingParams
from radixrt.testing import ScriptedRunner, scripted_model_config

MODEL = scripted_model_config(32000, 1 << 20)
CASES = {
    "plain": ({}, "none"),
    "penalties": ({"presence_penalty": 0.5}, "none"),
    "ngram": ({}, "ngram"),
}


def make_core(batch: int, case: str, block_size: int, kv_events: bool = False) -> EngineCore:
    params, spec = CASES[case]
    sched = SchedulerConfig(max_running_requests=batch, max_num_batched_tokens=max(8192, batch * 8))
    cfg = EngineConfig(model_path="-", overlap_schedule=True, scheduler=sched)
    events = {"kv_events": True, "kv_events_hash_seed": "0"} if kv_events else {}
    cache = replace(cfg.cache, block_size=block_size, **events)  # (runs on trees without them)
    cfg = replace(cfg, cache=cache)
    if spec != "none":
        cfg = replace(cfg, speculative=replace(cfg.speculative, speculative_method=spec))
    runner = ScriptedRunner(batch, block_size, lambda rid, pos: 11 + pos % 5000)
    blocks = batch * (2048 // block_size + 8)
    return EngineCore(cfg, MODEL, [2], runner=runner, num_kv_blocks=blocks)


def ready_core(
    batch: int, case: str, prompt_len: int, steps: int, block_size: int, kv_events: bool
):
    """A core whose `batch` rows all decode, and (with `kv_events`) a loopback publisher."""
    core = make_core(batch, case, block_size, kv_events)
    publisher = None
    if kv_events:
        from radixrt.server.kv_publisher import KVEventsConfig, ZmqEventPublisher

        publisher = ZmqEventPublisher(KVEventsConfig("tcp://127.0.0.1:0"))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + prompt_len, ignore_eos=True, **CASES[case][0])
    for _ in range(batch):
        core.add_request([rng.randrange(3, 32000) for _ in range(prompt_len)], params)
    while (
        any(r.num_computed < r.prompt_len for r in core.scheduler.running)
        or len(core.scheduler.running) < batch
    ):
        core.step()
    for _ in range(5):
        core.step()
    if kv_events:
        core.take_kv_events()
    return core, publisher


def time_steps(
    batch: int,
    case: str,
    prompt_len: int,
    steps: int,
    block_size: int,
    modes: list[bool],
    collect: bool = True,
) -> list[float]:
    """Median wall µs of one step once every row decodes, per KV-events mode (on: taking and
    publishing the step's events too). Several modes run side by side, one step of each in
    turn (the order alternating), so load on the machine hits them alike. `collect` False:
    Python's cyclic garbage collector is off while timing (its collections land in random
    steps and dominate a short run)."""
    cores = [ready_core(batch, case, prompt_len, steps, block_size, on) for on in modes]
    times: list[list[float]] = [[] for _ in modes]
    gc.collect()
    if not collect:
        gc.disable()
    for i in range(steps):
        order = range(len(cores)) if i % 2 == 0 else reversed(range(len(cores)))
        for k in order:
            core, publisher = cores[k]
            t = time.perf_counter()
            core.step()
            if publisher is not None:
                events = core.take_kv_events()
                if events:
                    publisher.publish(events)
            times[k].append(time.perf_counter() - t)
    gc.enable()
    for _, publisher in cores:
        if publisher is not None:
            publisher.shutdown()
    return [statistics.median(t) * 1e6 for t in times]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,32,256")
    ap.add_argument("--cases", default="plain,penalties,ngram")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--kv-events",
        default="off",
        choices=["off", "on", "both"],
        help="record and publish KV events (both: a core of each, steps interleaved)",
    )
    ap.add_argument("--no-gc", action="store_true", help="garbage collector off while timing")
    args = ap.parse_args(argv)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.kv_events]
    print("| case | B | KV events | µs / step |\n|---|---|---|---|")
    for case in args.cases.split(","):
        for b in map(int, args.batch.split(",")):
            times = time_steps(
                b, case, args.prompt_len, args.steps, args.block_size, modes, not args.no_gc
            )
            for on, us in zip(modes, times):
                print(f"| {case} | {b} | {'on' if on else 'off'} | {us:.0f} |", flush=True)


if __name__ == "__main__":
    main()
