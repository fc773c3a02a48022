"""How one program runs under one configuration: the configs, the client, the counters."""

from __future__ import annotations

import argparse
import contextlib
import re
import time
import urllib.request
from dataclasses import asdict, dataclass

from .accounting import Call, CallLog, replay, same_calls
from .base import ProgramSpec
from .dsl_clients import Recording, run_dsl


@dataclass(frozen=True)
class Config:
    name: str
    client: str  # dsl (in-process engine) | dsl-http | openai-seq | openai-async (server)
    cache: str = "radix"
    policy: str = "lpm"
    hints: bool = True  # frontend hints: prefixes sent ahead
    parallel: bool = True  # frontend parallelism: forks run concurrently
    admission: bool = True  # run_batch's program admission under cache pressure

    @property
    def on_server(self) -> bool:
        return self.client != "dsl"


CONFIGS = {
    c.name: c
    for c in (
        Config("radix", "dsl"),
        Config("blockhash", "dsl", "blockhash", "fcfs"),
        Config("no-cache", "dsl", "none", "fcfs"),
        Config("fcfs", "dsl", "radix", "fcfs"),
        Config("random", "dsl", "radix", "random"),
        Config("no-parallel", "dsl", parallel=False),
        Config("no-hints", "dsl", hints=False),
        Config("no-admission", "dsl", admission=False),
        Config("dsl-http", "dsl-http"),
        Config("openai-seq", "openai-seq"),
        Config("openai-async", "openai-async"),
    )
}


@dataclass
class Plan:
    spec: ProgramSpec
    inputs: list[dict]  # the concurrent run
    latency_inputs: list[dict]  # run one at a time afterwards
    warmup_inputs: list[dict]  # one program of other inputs (seed + 1), run first
    reference: list[Call]  # the dry run's calls
    working_set_tokens: int
    max_context: int  # longest prompt + output


def run_config(cfg: Config, plan: Plan, target, args: argparse.Namespace, history: list) -> dict:
    """One program under one config on `target` (an Engine or a server URL): a warm-up
    program (other inputs: grammar compiles, first-call costs), the concurrent run, then
    the latency runs. `history`: every call `target` served since its cache was last empty
    (extended here); the optimum of the run replays it first."""
    spec, engine = plan.spec, not isinstance(target, str)
    threads = min(args.max_concurrency, len(plan.inputs))
    client = Client(cfg, target, args)
    warm = CallLog()
    client.run(spec, plan.warmup_inputs, warm, 1)
    if engine:  # the engine's cache starts empty; a server's keeps what it served
        client.reset_cache()
        history.clear()
    else:
        history += warm.calls
    log = CallLog()
    before = _counters(target)
    sampler = getattr(args, "stack_sampler", None)  # --sample-stacks
    phase = sampler.phase(f"{cfg.name}/{spec.name}") if sampler else contextlib.nullcontext()
    start = time.perf_counter()
    with phase:
        client.run(spec, plan.inputs, log, threads)
    duration = time.perf_counter() - start
    after = _counters(target)
    rp = replay(log.calls, history)
    history += log.calls
    latencies = []
    for kw in plan.latency_inputs:
        lat = CallLog()
        t0 = time.perf_counter()
        client.run(spec, [kw], lat, 1)
        latencies.append(time.perf_counter() - t0)
        history += lat.calls
    client.close()  # its engine thread applies the holds released before it stops
    if engine:
        target.check_integrity()
        _reset_cache(target)
        history.clear()
    calls = log.calls
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    optimal = rp.optimal_cached_tokens
    return {
        "program": spec.name,
        "config": cfg.name,
        **{k: v for k, v in asdict(cfg).items() if k != "name"},
        "num_programs": len(plan.inputs),
        "duration_s": duration,
        "programs_per_s": len(plan.inputs) / duration,
        "latency_s": sum(latencies) / len(latencies) if latencies else None,
        "latencies_s": latencies,
        "calls": sum(c.kind != "hint" for c in calls),
        "hint_calls": sum(c.kind == "hint" for c in calls),
        "prompt_tokens": prompt,
        "recorded_prompt_tokens": rp.prompt_tokens,  # the client's count of the same
        "cached_tokens": cached,
        "prompt_tokens_computed": after["prompt_tokens_computed"]
        - before["prompt_tokens_computed"],
        "hit_rate": cached / prompt if prompt else 0.0,
        "optimal_hit_rate": optimal / rp.prompt_tokens if rp.prompt_tokens else 0.0,
        "hit_over_optimal": cached / optimal if optimal else None,
        "same_calls": same_calls(calls, plan.reference),
        "working_set_tokens": plan.working_set_tokens,
        "preemptions": after.get("preemptions", 0) - before.get("preemptions", 0),
        "steps": after.get("steps", 0) - before.get("steps", 0),  # in-process engine only
        **{k: after[k] - before[k] for k in RETENTION_COUNTERS if k in after},
    }


class Client:
    """A config's client of `target`, built once (outside the timed runs): the DSL over an
    EngineBackend or a RuntimeEndpoint, or an OpenAI client loop."""

    def __init__(self, cfg: Config, target, args: argparse.Namespace) -> None:
        from radixrt.frontend import EngineBackend, RuntimeEndpoint

        self.cfg, self.target, self.args = cfg, target, args
        self.backend = self.openai = None
        if cfg.client == "dsl":
            self.backend = EngineBackend(target)
        elif cfg.client == "dsl-http":
            self.backend = RuntimeEndpoint(target, model_path=args.resolved_model)
        else:
            from .openai_clients import OpenAIRunner

            concurrent = cfg.client == "openai-async"
            self.openai = OpenAIRunner(target, args.resolved_model, args.tokenizer, concurrent)

    def run(self, spec: ProgramSpec, inputs: list[dict], log: CallLog, threads: int) -> None:
        """Run `spec` on `inputs`, `threads` programs at a time, recording into `log`."""
        if self.backend is None:
            self.openai.run(spec, inputs, log, threads)
            return
        run_dsl(spec, inputs, Recording(self.backend, log), threads=threads,
                hints=self.cfg.hints, parallel=self.cfg.parallel,
                admission=self.cfg.admission)  # fmt: skip

    def reset_cache(self) -> None:
        """Empty an in-process engine's prefix cache on the client's engine thread, after
        the holds the programs released: `release_cache_holds` only queues them, and a
        reset from this thread that overtook them kept the held paths, which the next run
        then hit (more than its optimum, replayed from an empty cache, allows)."""
        self.backend.run_on_engine(_reset_cache)

    def close(self) -> None:
        (self.backend or self.openai).close()


def _reset_cache(engine) -> None:
    """Empty the engine's prefix cache; nothing may stay (no hold, no locked path): the
    optimum of the next run assumes an empty cache."""
    engine.cache.reset()
    assert engine.allocator.num_used == 0, "blocks in use after resetting the cache"


# the engine's holds: taken, refused (no room under the share), given up for room, expired
RETENTION_COUNTERS = ("retention_holds", "retention_refused", "retention_released",
                      "retention_expired")  # fmt: skip


def _counters(target) -> dict:
    """Prompt, cached and computed prompt tokens (preemptions, steps and the holds' counters
    in-process) so far."""
    if not isinstance(target, str):
        s = target.stats()
        return {k: int(s[k]) for k in ("prompt_tokens", "cached_tokens", "prompt_tokens_computed",
                                        "preemptions", "steps", *RETENTION_COUNTERS)}  # fmt: skip
    with urllib.request.urlopen(target + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for key in ("prompt_tokens", "cached_tokens"):
        m = re.search(rf"^radixrt_{key}_total (\S+)$", text, re.M)
        out[key] = int(float(m.group(1))) if m else 0
    out["prompt_tokens_computed"] = out["prompt_tokens"] - out["cached_tokens"]
    return out
