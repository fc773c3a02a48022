"""Verify rows vs plain decode, and speedup vs acceptance with an ORACLE proposer.

GPU (default): dummy Llama-3-8B (bf16, random weights, flashinfer), one GPU.
1. `steps`: ModelRunner step time (execute + host round trip, median) of B rows with CONTEXT
   cached tokens: plain decode (CUDA graph and eager) vs verify rows of k + 1 tokens
   (k = 1..5; graph = the verify rows replayed the decode CUDA graphs as one decode row per
   token, else the eager forward with the prefill kernel). With `--draft-preset`, also verify
   steps of the draft-model path (k draft steps + the draft's KV fill + target verify) with a
   dummy draft.
2. `oracle`: B requests through EngineCore with FORCED acceptance: every verify row accepts
   a number of its k drafts drawn as the leading successes of Bernoulli(ALPHA) trials (the
   runner's verification is replaced by that draw; the drafts are placeholders), so the
   acceptance rate is set, not real (random weights make real acceptance meaningless, and
   near-flat random logits flip argmax between kernels, which made an oracle that drafts the
   true greedy continuation unreliable). Everything else (k + 1-token rows, graphs, rollback
   of rejected slots, overlap) runs as served. Decode tokens/s vs plain decode at each ALPHA;
   the measured acceptance is printed next to the set one. The tokens emitted are the
   target's samples, not the drafts (timing only: do not read the outputs).
CPU smoke (`--tiny`): the tiny model, fewer cases and steps.

    python -m benchmarks.bench_verify --json verify.json [--draft-preset llama-1b]
    python -m benchmarks.bench_verify --tiny      # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from radixrt.config import ModelConfig, resolve_config
from radixrt.engine.core import EngineCore
from radixrt.executor.runner import ModelRunner
from radixrt.plan import PlanRow, SlotEntry, StepPlan
from radixrt.sampling import SamplingParams
from radixrt.speculative.base import Proposer

GREEDY = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
BLOCK_SIZE = 16
# A Llama-3.2-1B-shaped dummy draft with Llama-3's vocabulary (random weights).
DRAFT_PRESETS = {
    "llama-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
}


class Setup:
    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        if tiny:
            from radixrt.model.tiny import ensure_tiny_model

            self.model_dir = ensure_tiny_model()
            self.device, self.dtype, self.load, self.backend = "cpu", "float32", "auto", "torch"
            self.batches, self.ks, self.context, self.iters = (1, 4), (1, 3), 64, 5
            self.alphas, self.max_tokens = (0.0, 0.8, 1.0), 24
        else:
            from radixrt.model.presets import write_dummy_model_dir

            self.model_dir = write_dummy_model_dir(
                os.path.join(tempfile.mkdtemp(), "llama-3-8b"), "llama-3-8b"
            )
            self.device, self.dtype, self.load, self.backend = (
                "cuda",
                "bfloat16",
                "dummy",
                "flashinfer",
            )
            self.batches, self.ks, self.context, self.iters = (1, 8, 32), (1, 2, 3, 4, 5), 1024, 20
            self.alphas, self.max_tokens = (0.0, 0.5, 0.7, 0.8, 0.9, 1.0), 64
        self.model_cfg = ModelConfig.from_pretrained(self.model_dir)

    def config(self, **options):
        return resolve_config(
            self.model_dir,
            device=self.device,
            dtype=self.dtype,
            load_format=self.load,
            attention_backend=self.backend,
            block_size=BLOCK_SIZE,
            **options,
        )

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def verify_plan(runner: ModelRunner, batch: int, context: int, k: int, rng) -> StepPlan:
    """B rows with `context` cached tokens feeding 1 + k tokens (k = 0: plain decode), k
    drafts verified (random ids: KV and token values do not matter for timing)."""
    vocab = runner.model_cfg.vocab_size
    per_row = math.ceil((context + k + 1) / BLOCK_SIZE)
    rows = []
    for i in range(batch):
        rows.append(
            PlanRow(
                rid=f"r{i}",
                slot=i,
                start=context,
                num_tokens=k + 1,
                input_ids=rng.integers(0, vocab, k + 1).tolist(),
                new_blocks=list(range(i * per_row, (i + 1) * per_row)),
                sample_offsets=list(range(k + 1)),
                num_draft_tokens=k,
            )
        )
    runner.enter_slots([SlotEntry(i, 1, GREEDY) for i in range(batch)])
    device = k > 0 and runner.draft is not None
    drafts = {} if device or not k else {i: r.input_ids[1:] for i, r in enumerate(rows)}
    for r in rows:
        r.input_ids = r.input_ids[:1]
    return StepPlan(0, rows, drafts=drafts, device_drafts=list(range(batch)) if device else [])


def step_ms(s: Setup, runner: ModelRunner, plan: StepPlan, graph: bool) -> float:
    for _ in range(3):
        runner.execute(plan, use_cuda_graph=graph).result()
    times = []
    for _ in range(s.iters):
        s.sync()
        t0 = time.perf_counter()
        runner.execute(plan, use_cuda_graph=graph).result()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_steps(s: Setup, rng, draft_dir: str | None) -> list[dict]:
    slots = max(s.batches)
    blocks = slots * math.ceil((s.context + max(s.ks) + 1) / BLOCK_SIZE) + 1
    opts = dict(num_kv_blocks=blocks, max_running_requests=slots, max_model_len=s.context + 64)
    # a proposer configured with k = max(ks): the decode graphs are sized for verify rows
    opts |= dict(speculative_method="ngram", num_speculative_tokens=max(s.ks))
    if draft_dir is not None:
        opts |= dict(speculative_method="draft", speculative_draft_model=draft_dir)
    cfg = s.config(enable_cuda_graph=s.device == "cuda", **opts)
    runner = ModelRunner(cfg, s.model_cfg, s.context + 64, slots)
    runner.pool.kv.uniform_(-1.0, 1.0)
    label = "draft-model" if draft_dir else "host-drafts"
    rows = []
    for b in s.batches:
        base = None
        for k in (0, *s.ks):
            plan = verify_plan(runner, b, s.context, k, rng)
            graphs = runner.cuda_graphs
            graph_used = bool(graphs and graphs.can_run(plan, runner._begin(plan)))
            # draft-model verify steps: graph = the draft's k one-token steps replay graphs
            draft_graphs = draft_dir is not None and k > 0 and graphs is not None
            for graph in (True, False) if graph_used or draft_graphs else (False,):
                ms = step_ms(s, runner, plan, graph)
                if k == 0 and not graph:
                    base = ms
                row = dict(kind=label, batch=b, k=k, graph=graph, ms=ms)
                rows.append(row)
            rows[-1]["vs_eager_decode"] = rows[-1]["ms"] / base if base else None
            print(f"steps {rows[-1]}", flush=True)
    del runner
    return rows


class PlaceholderProposer(Proposer):
    """Drafts k placeholder tokens for every row (what they are does not matter: the oracle
    decides acceptance, see `ForcedAcceptance`)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, tokens, max_drafts: int, salt: str | None = None) -> list[int]:
        return [(tokens[-1] + 7) % self.vocab] * max_drafts


class ForcedAcceptance:
    """ORACLE: replaces `runner.sampler.verify` (installed on the instance, removed by `remove`):
    each drafting row accepts the leading successes of Bernoulli(alpha) trials over its
    drafts (seeded), independent of the logits."""

    def __init__(self, runner: ModelRunner, alpha: float, seed: int = 0) -> None:
        self.runner, self.alpha = runner, alpha
        self.rng = np.random.default_rng(seed)
        runner.sampler.verify = self

    def __call__(self, ctx, tokens) -> torch.Tensor:
        plan, rows = ctx.plan, ctx.drafting
        n = np.asarray([plan.rows[i].num_draft_tokens for i in rows])
        hits = self.rng.random((len(rows), int(n.max()))) < self.alpha
        hits &= np.arange(hits.shape[1]) < n[:, None]
        accepted = np.cumprod(hits, axis=1).sum(axis=1)
        return torch.from_numpy(accepted.astype(np.int64)).to(tokens.device)

    def remove(self) -> None:
        del self.runner.sampler.verify


def run_core(s: Setup, core: EngineCore, prompts: list[list[int]]) -> tuple[dict, float, int]:
    params = SamplingParams(temperature=0, max_tokens=s.max_tokens, ignore_eos=True)
    rids = [core.add_request(p, params) for p in prompts]
    outs: dict[str, list[int]] = {r: [] for r in rids}

    def step():
        for d in core.step():
            outs[d.rid] += d.new_token_ids

    while any(not o for o in outs.values()):  # prefill: every request has its first token
        step()
    s.sync()
    first = sum(map(len, outs.values()))
    t0 = time.perf_counter()
    while core.has_work:
        step()
    s.sync()
    seconds = time.perf_counter() - t0
    core.check_integrity()
    by_prompt = {tuple(p): outs[r] for p, r in zip(prompts, rids)}
    return by_prompt, seconds, sum(map(len, outs.values())) - first


def bench_oracle(s: Setup, rng, ks: tuple[int, ...]) -> list[dict]:
    """Per B: a plain run (overlap as resolved: on for CUDA), then one run per (k, ALPHA)
    with forced acceptance; all EngineCores share one runner."""
    rows = []
    vocab = s.model_cfg.vocab_size
    b_max, k_max = max(s.batches), max(ks)
    blocks = b_max * math.ceil((s.context + s.max_tokens + k_max + 2) / BLOCK_SIZE) + 2
    opts = dict(num_kv_blocks=blocks, max_running_requests=b_max)
    cfg = s.config(**opts)
    # the shared runner's decode graphs are sized for verify rows of k_max drafts
    sized = s.config(speculative_method="ngram", num_speculative_tokens=k_max, **opts)
    shared = EngineCore(sized, s.model_cfg, [])
    runner, num_blocks = shared.runner, shared.allocator.num_blocks
    for b in s.batches:
        prompts = [rng.integers(0, vocab, s.context).tolist() for _ in range(b)]
        plain = EngineCore(cfg, s.model_cfg, [], runner=runner, num_kv_blocks=num_blocks)
        _, sec, toks = run_core(s, plain, prompts)
        base = toks / sec
        rows.append(dict(batch=b, k=0, alpha=None, tok_s=base, speedup=1.0))
        print(f"oracle {rows[-1]}", flush=True)
        for k in ks:
            # any proposer makes the scheduler plan verify rows: the oracle replaces ngram
            spec_cfg = s.config(speculative_method="ngram", num_speculative_tokens=k, **opts)
            for alpha in s.alphas:
                spec = EngineCore(
                    spec_cfg, s.model_cfg, [], runner=runner, num_kv_blocks=num_blocks
                )
                spec.scheduler.use_proposer(PlaceholderProposer(vocab))
                forced = ForcedAcceptance(runner, alpha)
                _, sec, toks = run_core(s, spec, prompts)
                forced.remove()
                st = spec.stats()
                rows.append(
                    dict(
                        batch=b,
                        k=k,
                        alpha=alpha,
                        measured_acceptance=st["spec_acceptance_rate"],
                        tokens_per_verify=st["spec_mean_acceptance_length"],
                        tok_s=toks / sec,
                        speedup=toks / sec / base,
                    )
                )
                print(f"oracle {rows[-1]}", flush=True)
    return rows


def write_draft_dir(preset: str) -> str:
    from radixrt.model.tiny_tokenizer import write_tiny_tokenizer

    out = os.path.join(tempfile.mkdtemp(), preset)
    os.makedirs(out)
    write_tiny_tokenizer(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(DRAFT_PRESETS[preset], f)
    return out


def tables(steps: list[dict], oracle: list[dict], where: str) -> str:
    out = [f"## Verify rows vs decode ({where}); eager unless graph = yes", ""]
    out += ["| drafts | B | k | graph | ms/step | vs eager decode |", "|---|---|---|---|---|---|"]
    for r in steps:
        rel = f"{r['vs_eager_decode']:.2f}x" if r.get("vs_eager_decode") else "-"
        graph = "yes" if r["graph"] else "no"
        out.append(f"| {r['kind']} | {r['batch']} | {r['k']} | {graph} | {r['ms']:.2f} | {rel} |")
    out += ["", f"## ORACLE, forced acceptance (set, not real): decode tok/s ({where})", ""]
    out += [
        "| B | k | set alpha | measured acceptance | tokens/verify | tok/s | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in oracle:
        if r["alpha"] is None:
            out.append(f"| {r['batch']} | - | plain | - | 1 | {r['tok_s']:.0f} | 1.00x |")
        else:
            out.append(
                f"| {r['batch']} | {r['k']} | {r['alpha']:.1f} | {r['measured_acceptance']:.2f} "
                f"| {r['tokens_per_verify']:.2f} | {r['tok_s']:.0f} | {r['speedup']:.2f}x |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke on the tiny model")
    ap.add_argument("--json", help="write all rows here")
    ap.add_argument("--draft-preset", choices=sorted(DRAFT_PRESETS), help="GPU: dummy draft")
    ap.add_argument("--skip-oracle", action="store_true")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--oracle-ks", default=None, help="k values of the oracle runs (1,3,5)")
    ap.add_argument("--max-tokens", type=int, default=None, help="oracle: output per request")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    s = Setup(args.tiny)
    if s.tiny:
        torch.set_num_threads(1)
    if args.max_tokens:
        s.max_tokens = args.max_tokens
    steps = [] if args.skip_steps else bench_steps(s, rng, None)
    draft_dir = s.model_dir if s.tiny else None
    if args.draft_preset:
        draft_dir = write_draft_dir(args.draft_preset)
    if draft_dir is not None and not args.skip_steps:
        steps += bench_steps(s, rng, draft_dir)
    default_ks = s.ks if s.tiny else (1, 3, 5)
    ks = tuple(int(k) for k in args.oracle_ks.split(",")) if args.oracle_ks else default_ks
    oracle = [] if args.skip_oracle else bench_oracle(s, rng, ks)
    where = "CPU, tiny model" if s.tiny else "H200, dummy Llama-3-8B bf16, flashinfer"
    print()
    print(tables(steps, oracle, where + f", context {s.context}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": steps, "oracle": oracle, "where": where}, f, indent=1)


if __name__ == "__main__":
    main()
