"""The suite without a model: the real scheduler, caches and DSL over a scripted runner
(`radixrt.testing.ScriptedRunner`) that emits each gen's forced token (its logit bias) and
takes `step_s` seconds per step, standing in for the GPU's forward. What a configuration
caches, evicts and recomputes is then what the GPU run does with the same calls, on a CPU in
seconds (the timing is the stand-in's, not a GPU's)."""

from __future__ import annotations

import time

from radixrt.config import CacheConfig
from radixrt.engine import Engine
from radixrt.testing import ScriptedRunner

# programs whose gens need a model (grammar-constrained output): not simulated
NEEDS_MODEL = ("json",)


def scripted_engine(
    model_dir: str, filler_token: int, step_s: float, token_s: float = 0.0, **options
) -> Engine:
    """An Engine on `model_dir`'s config and tokenizer whose runner emits, for every request,
    the token its logit bias forces (`filler_token` without a bias) after sleeping `step_s`
    per step plus `token_s` per token the step feeds (prefill costs time too). `options` as
    for Engine (`num_kv_blocks` None: the engine's CPU pool size)."""
    engine: Engine | None = None

    def token(rid: str, position: int) -> int:
        req = engine.scheduler.requests.get(rid) if engine is not None else None
        bias = req.params.logit_bias if req is not None else None
        return max(bias, key=lambda kv: kv[1])[0] if bias else filler_token

    options = {**options, "device": "cpu", "load_format": "dummy"}
    if options.get("num_kv_blocks") is None:
        options["num_kv_blocks"] = CacheConfig().cpu_kv_blocks
    runner = ScriptedRunner(options.get("max_running_requests", 256), options["block_size"], token)
    if step_s > 0 or token_s > 0:
        execute = runner.execute

        def timed(plan):
            time.sleep(step_s + token_s * sum(row.num_tokens for row in plan.rows))
            return execute(plan)

        runner.execute = timed
    engine = Engine(model_dir, runner=runner, **options)
    return engine
