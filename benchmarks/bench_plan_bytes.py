"""Bytes per step of what the tensor-parallel runner broadcasts (the encoded step plan).

B requests of CONTEXT random prompt tokens through an EngineCore with a scripted runner (no
model, overlap on); every plan is encoded by one `PlanEncoder` in order (so per-request data
sent once is not counted again) and the median size of the pure-decode plans is reported, per
case: plain greedy rows, presence_penalty on every row, seeded sampling.

    python -m benchmarks.bench_plan_bytes [--batch 256] [--context 1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import replace

from radixrt.config import EngineConfig, SchedulerConfig
from radixrt.engine.core import EngineCore
from radixrt.executor.tp.plan_codec import PlanEncoder
from radixrt.sampling import SamplingParams
from radixrt.testing import ScriptedRunner, scripted_model_config

MODEL = scripted_model_config(128256)
CASES = {
    "plain": dict(temperature=0),
    "presence_penalty": dict(temperature=0, presence_penalty=0.5),
    "seeded": dict(temperature=0.8, seed=1),
}


def plan_bytes(batch: int, context: int, steps: int, params: SamplingParams) -> dict:
    block_size = 16
    sched = SchedulerConfig(max_running_requests=batch, max_num_batched_tokens=batch * context)
    cfg = EngineConfig(model_path="-", overlap_schedule=True, scheduler=sched)
    cfg = replace(cfg, cache=replace(cfg.cache, block_size=block_size, prefix_cache="none"))
    blocks = batch * ((context + steps + 8) // block_size + 2)
    runner = ScriptedRunner(batch, block_size)
    core = EngineCore(cfg, MODEL, [], runner=runner, num_kv_blocks=blocks)
    encoder = PlanEncoder()
    sizes: list[tuple[bool, int]] = []
    execute = runner.execute

    def encoded(plan):
        decode = all(r.num_tokens == 1 for r in plan.rows) and len(plan.rows) == batch
        sizes.append((decode, len(encoder.encode(plan))))
        return execute(plan)

    runner.execute = encoded
    rng = random.Random(0)
    for _ in range(batch):
        core.add_request([rng.randrange(10, 30000) for _ in range(context)], params)
    while core.has_work:
        core.step()
    decode = [n for d, n in sizes if d]
    return dict(
        decode_steps=len(decode),
        bytes_per_decode_step=statistics.median(decode),
        bytes_all_steps=sum(n for _, n in sizes),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16, help="output tokens per request")
    args = ap.parse_args()
    for name, kw in CASES.items():
        p = SamplingParams(max_tokens=args.steps, ignore_eos=True, **kw)
        print(name, plan_bytes(args.batch, args.context, args.steps, p))


if __name__ == "__main__":
    main()
