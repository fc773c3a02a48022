"""KV memory of n > 1 forks and beam search against independent requests, next to the block
count the design predicts (copy-on-write block sharing, radixrt.scheduler.groups).

Three runs of one prompt (random token ids) with `prefix_cache=none` (so nothing is shared
but what a fork shares by reference): `n` = W sampled children (one request, temperature 1,
seeded), a beam search of width W, and W independent requests of the same prompt. Every run
generates `--output-len` tokens per sequence (ignore_eos). Measured: the peak number of KV
blocks in use (the allocator's used count after every allocation), wall time and sequence
tokens per second. Predicted (block size B, prompt P, output O, a sequence holds KV for its
P + O - 1 computed positions):

- independent: W * ceil((P + O - 1) / B)
- n = W: the parent computes P - 1 prompt tokens, then forks: (P - 1) // B full blocks are
  shared once, each child holds its own ceil((P + O - 1) / B) - (P - 1) // B blocks (the
  partial prompt block is copied for W - 1 children: those copies are among them).
- beam W: two live beams share block k iff k < d // B, d the first position where their
  tokens differ (a re-parented beam references its source's full blocks and copies the
  partial one); at each beam step the blocks in use are, per block index, the number of
  classes of beams sharing it. Predicted peak: the largest such count over the search (and
  the prefill before it).

Measured peak must equal predicted (asserted unless --no-check).

    # GPU (H200): dummy Llama-3-8B, bf16
    python -m benchmarks.bench_fork --model llama-3-8b --device cuda --json fork.json
    # CPU smoke (the tiny model)
    python -m benchmarks.bench_fork --model tiny --device cpu --prompt-len 64 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Sequence

CASES = ("n", "beam", "independent")


def build_core(args):
    """The EngineCore of `args.model`: "tiny" (the trained tiny checkpoint), a preset name of
    radixrt.model.presets (dummy weights), or a model directory."""
    from radixrt.config import ModelConfig, resolve_config
    from radixrt.engine.core import EngineCore
    from radixrt.model.presets import PRESETS, write_dummy_model_dir

    options: dict[str, object] = dict(prefix_cache="none", block_size=args.block_size)
    if args.model == "tiny":
        from radixrt.model.tiny import ensure_tiny_model

        path = ensure_tiny_model()
    elif args.model in PRESETS:
        path = write_dummy_model_dir(tempfile.mkdtemp(prefix="bench-fork-"), args.model)
        options["load_format"] = "dummy"
    else:
        path = args.model
    if args.load_format == "dummy":
        options["load_format"] = "dummy"
    if args.num_kv_blocks:
        options["num_kv_blocks"] = args.num_kv_blocks
    if args.device == "cpu":
        options["cpu_threads"] = args.threads
    if args.overlap != "auto":
        options["overlap_schedule"] = args.overlap == "on"
    cfg = resolve_config(path, args.device, args.dtype, **options)
    model_config = ModelConfig.from_pretrained(path)
    return EngineCore(cfg, model_config, model_config.eos_token_ids)


def blocks_of_independent(p: int, o: int, b: int, w: int) -> int:
    return w * math.ceil((p + o - 1) / b)


def blocks_of_fork(p: int, o: int, b: int, w: int) -> int:
    shared = (p - 1) // b
    return shared + w * (math.ceil((p + o - 1) / b) - shared)


def blocks_of_beams(seqs: Sequence[Sequence[int]], b: int) -> int:
    """Blocks live beams hold for their next step (KV of positions [0, len)): per block
    index k, the classes of beams whose tokens agree before position d with k < d // B."""
    length = len(seqs[0])
    assert all(len(s) == length for s in seqs)
    total = 0
    for k in range(math.ceil(length / b)):
        classes: list[Sequence[int]] = []
        for s in seqs:
            if not any(_first_difference(s, c) // b > k for c in classes):
                classes.append(s)
        total += len(classes)
    return total


def _first_difference(a: Sequence[int], c: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, c)):
        if x != y:
            return i
    return min(len(a), len(c))


class PeakMeter:
    """Peak of the allocator's used blocks, sampled after every allocation."""

    def __init__(self, allocator) -> None:
        self.allocator = allocator
        self.peak = allocator.num_used
        self._allocate = allocator.allocate

        def allocate(n: int):
            blocks = self._allocate(n)
            self.peak = max(self.peak, allocator.num_used)
            return blocks

        allocator.allocate = allocate

    def reset(self) -> None:
        self.peak = self.allocator.num_used


def run_case(core, meter: PeakMeter, case: str, prompt: list[int], args) -> dict:
    from radixrt.sampling import BeamSearchParams, SamplingParams

    p, o, b, w = len(prompt), args.output_len, args.block_size, args.width
    sched = core.scheduler
    beam_predictions = [math.ceil((p - 1) / b), math.ceil(p / b)]  # parent, first beam
    beam_step = sched.groups._beam_step

    def recording_beam_step(g, changed):
        beam_step(g, changed)
        if not g.beam.done:
            beam_predictions.append(blocks_of_beams([c.seq_token_ids for c in g.children], b))

    sched.groups._beam_step = recording_beam_step
    before = core.stats()
    meter.reset()
    start = time.perf_counter()
    try:
        if case == "n":
            params = SamplingParams(max_tokens=o, temperature=1.0, seed=1, ignore_eos=True, n=w)
            core.add_request(prompt, params)
            predicted = blocks_of_fork(p, o, b, w)
        elif case == "beam":
            core.add_beam_search(prompt, BeamSearchParams(w, o, ignore_eos=True))
        else:
            for i in range(w):
                params = SamplingParams(max_tokens=o, temperature=1.0, seed=1 + i, ignore_eos=True)
                core.add_request(prompt, params)
            predicted = blocks_of_independent(p, o, b, w)
        while core.has_work:
            core.step()
        _sync(args.device)
    finally:
        sched.groups._beam_step = beam_step
    duration = time.perf_counter() - start
    core.check_integrity()
    if case == "beam":
        predicted = max(beam_predictions)
    after = core.stats()
    diff = {k: int(after[k] - before[k]) for k in COUNTERS}
    tokens = w * o
    return dict(
        case=case,
        width=w,
        prompt_len=p,
        output_len=o,
        block_size=b,
        peak_blocks=meter.peak,
        predicted_blocks=predicted,
        duration_s=duration,
        seq_tok_per_s=tokens / duration,
        **diff,
    )


COUNTERS = (
    "steps",
    "prompt_tokens_computed",
    "forks",
    "fork_shared_blocks",
    "fork_copied_blocks",
    "beam_steps",
    "beam_shared_blocks",
    "beam_copied_blocks",
)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def table(rows: list[dict]) -> str:
    ind = next((r for r in rows if r["case"] == "independent"), None)
    out = [
        "| case | peak KV blocks | predicted | saved vs independent | seq tok/s | time s "
        "| shared (fork / beam) | copied (fork / beam) | beam steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        saved = f"{1 - r['peak_blocks'] / ind['peak_blocks']:.1%}" if ind else "-"
        name = {"n": f"n = {r['width']}", "beam": f"beam {r['width']}"}.get(
            r["case"], f"{r['width']} independent"
        )
        cells = [
            name,
            r["peak_blocks"],
            r["predicted_blocks"],
            saved,
            f"{r['seq_tok_per_s']:.0f}",
            f"{r['duration_s']:.2f}",
            f"{r['fork_shared_blocks']} / {r['beam_shared_blocks']}",
            f"{r['fork_copied_blocks']} / {r['beam_copied_blocks']}",
            r["beam_steps"],
        ]
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b", help="tiny | a preset (dummy) | a dir")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="presets: dummy"
    )
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--width", type=int, default=4, help="n, beam width, independent requests")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--repeats", type=int, default=1, help="timed runs per case (best kept)")
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--no-check", action="store_true", help="do not assert peak == predicted")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    core = build_core(args)
    meter = PeakMeter(core.allocator)
    vocab = core.model_config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(10, min(vocab, 1000)) for _ in range(args.prompt_len)]
    run_case(core, meter, "independent", prompt[: min(32, len(prompt))], args)  # warm-up
    rows = []
    for case in args.cases.split(","):
        runs = [run_case(core, meter, case, prompt, args) for _ in range(args.repeats)]
        row = min(runs, key=lambda r: r["duration_s"])
        rows.append(row)
        ok = row["peak_blocks"] == row["predicted_blocks"]
        print(
            f"{case:>11}: peak {row['peak_blocks']} blocks, predicted {row['predicted_blocks']}"
            f" ({'equal' if ok else 'DIFFERENT'}), {row['seq_tok_per_s']:.0f} seq tok/s",
            flush=True,
        )
    print()
    print(table(rows))
    core.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "pid": os.getpid(), "rows": rows}, f, indent=1)
    if not args.no_check:
        bad = [r["case"] for r in rows if r["peak_blocks"] != r["predicted_blocks"]]
        assert not bad, f"measured peak != predicted for {bad}"
    return rows


if __name__ == "__main__":
    main()
