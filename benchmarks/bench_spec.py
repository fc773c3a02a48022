"""Speculative decoding on the tiny model (CPU, in-process Engine): steps, acceptance and
tokens/s of each proposer against none, and how often the radix proposer fires.

Each workload (greedy, ignore_eos) runs twice on one engine: pass 1 is the program as it
comes (cold cache), pass 2 re-runs the same program (a repeated program: a retried agent, a
regenerated answer; the radix tree holds every answer). Outputs of every method are checked
to equal those of `none` (exactness), integrity after every pass.

Workloads: benchmarks/workloads.py (random token ids: acceptance there is not meaningful), or
with `--text` TEXT workloads in the tiny model's chat template (`text_workload`): `chat`
(multi-turn: users ask questions from the training chats, each turn extends the conversation)
and `agent` (ReAct: a tool prompt, a task, then thought/action outputs each followed by an
observation sentence). `--draft-model DIR` adds the `draft` method (a trained smaller tiny
model: `make_draft_model`).

    python -m benchmarks.bench_spec --json spec.json
    python -m benchmarks.bench_spec --text --draft-model auto --json text.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from benchmarks.engine_driver import run_engine
from benchmarks.workloads import Call, Program, Workload, make_workload

METHODS = ("none", "ngram", "radix")
WORKLOADS = ("multi-turn", "agent", "tree-of-thought", "random")
SPEC_KEYS = (
    "steps",
    "generated_tokens",
    "spec_proposals",
    "spec_proposals_with_drafts",
    "spec_verify_rows",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)


def run_pass(engine, workload) -> tuple[dict, list[tuple[int, ...]]]:
    """One pass of `workload`: counters (differences over the pass), time, and the sorted
    outputs of its calls (request ids differ between engines; the multiset does not)."""
    before = engine.stats()
    by_rid: dict[str, list[int]] = {}
    core = engine.core
    step = core.step

    def recording_step():
        deltas = step()
        for d in deltas:
            by_rid.setdefault(d.rid, []).extend(d.new_token_ids)
        return deltas

    core.step = recording_step
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        result = run_engine(engine, workload)
        duration = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    finally:
        core.step = step
    after = engine.stats()
    row = {k: int(after[k] - before[k]) for k in SPEC_KEYS}
    row["duration_s"] = duration
    row["output_tokens"] = sum(r.output_tokens for r in result.records)
    row["tok_per_s"] = row["output_tokens"] / duration
    # CPU seconds of this process: on a shared machine far steadier than wall time
    row["cpu_s"] = cpu
    row["tok_per_cpu_s"] = row["output_tokens"] / cpu
    drafted, accepted = row["spec_draft_tokens"], row["spec_accepted_tokens"]
    row["acceptance_rate"] = accepted / drafted if drafted else 0.0
    verify = row["spec_verify_rows"]
    row["mean_acceptance_length"] = 1 + accepted / verify if verify else 0.0
    asked = row["spec_proposals"]
    row["fire_rate"] = row["spec_proposals_with_drafts"] / asked if asked else 0.0
    return row, sorted(tuple(v) for v in by_rid.values())


TEXT_WORKLOADS = ("chat", "agent")
AGENT_SYSTEM = (
    "You are a helpful assistant who can use tools. To look something up, write Action: "
    "search[topic]. You will then see an Observation. Think step by step and answer "
    "briefly and kindly."
)
DRAFT_SHAPE = dict(num_layers=1, hidden_size=96, intermediate_size=256, num_heads=3)


def make_draft_model() -> str:
    """A trained 1-layer tiny model (the target's tokenizer and training text), cached."""
    from radixrt.model.tiny import make_tiny_model

    path = os.path.expanduser("~/.cache/radixrt/tiny-draft-1l-h96")
    if not os.path.exists(os.path.join(path, "radixrt_training.json")):
        make_tiny_model(path, num_kv_heads=1, progress=False, **DRAFT_SHAPE)
    return path


def _lines(prefix: str, files: tuple[str, ...]) -> list[str]:
    from radixrt.model.tiny_data import DATA_DIR

    out = []
    for name in files:
        with open(os.path.join(DATA_DIR, name)) as f:
            out += [ln[len(prefix) :].strip() for ln in f if ln.startswith(prefix)]
    return out


def text_workload(name: str, tokenizer, scale: float) -> Workload:
    """A TEXT workload in the tiny model's chat template (see the module docstring)."""
    enc = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    questions = _lines("User: ", ("chats.txt",))
    facts = [ln.strip() for ln in _lines("", ("corpus.txt",)) if len(ln.split()) > 8]
    count = max(1, round(8 * scale))
    programs = []
    for u in range(count):
        if name == "chat":
            calls = []
            for turn in range(4):
                q = questions[(u * 4 + turn) % len(questions)]
                head = "<|system|>\nYou are a helpful assistant.<|end|>\n" if turn == 0 else ""
                text = f"{head}<|user|>\n{q}<|end|>\n<|assistant|>\n"
                calls.append(Call(None if turn == 0 else turn - 1, enc(text), 32))
        elif name == "agent":
            q = questions[(u * 7) % len(questions)]
            first = f"<|system|>\n{AGENT_SYSTEM}<|end|>\n<|user|>\n{q}<|end|>\n<|assistant|>\n"
            first += "Thought:"
            calls = [Call(None, enc(first), 24)]
            for step in range(1, 4):
                obs = facts[(u * 3 + step) % len(facts)][:200]
                calls.append(Call(step - 1, enc(f"\nObservation: {obs}\nThought:"), 24))
        else:
            raise ValueError(f"unknown text workload {name!r}; allowed: {TEXT_WORKLOADS}")
        programs.append(Program(tuple(calls)))
    return Workload(name, tuple(programs), {"text": True, "count": count})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--ngram-min-n", type=int, default=2)
    p.add_argument("--ngram-max-n", type=int, default=4)
    p.add_argument("--scale", type=float, default=0.25, help="times the smoke size's count")
    p.add_argument("--model", default=None, help="model dir (default: the tiny model)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timing)")
    p.add_argument("--text", action="store_true", help="TEXT workloads (chat, agent)")
    p.add_argument("--draft-model", default=None, help="add method draft ('auto': trained)")
    args = p.parse_args(argv)
    if args.text and args.workloads == ",".join(WORKLOADS):
        args.workloads = ",".join(TEXT_WORKLOADS)
    draft = make_draft_model() if args.draft_model == "auto" else args.draft_model
    if draft and "draft" not in args.methods.split(","):
        args.methods += ",draft"
    import torch

    torch.set_num_threads(args.threads)

    from radixrt import Engine
    from radixrt.model.tiny import ensure_tiny_model

    model = args.model or ensure_tiny_model()
    rows = []
    for name in args.workloads.split(","):
        reference: dict[int, list[tuple[int, ...]]] = {}
        for method in args.methods.split(","):
            engine = Engine(
                model,
                device="cpu",
                dtype="float32",
                speculative_method=method,
                num_speculative_tokens=args.num_speculative_tokens,
                ngram_min_n=args.ngram_min_n,
                ngram_max_n=args.ngram_max_n,
                speculative_draft_model=draft if method == "draft" else None,
            )
            vocab = engine.model_config.vocab_size
            _warm_up(engine)
            if args.text:
                workload = text_workload(name, engine.tokenizer, args.scale * 4)
            else:
                workload = make_workload(name, "smoke", args.scale, vocab_size=vocab)
            for run in (1, 2):
                row, outputs = run_pass(engine, workload)
                engine.check_integrity()
                same = reference.setdefault(run, outputs) == outputs
                row.update(workload=name, method=method, run=run, same_outputs=same)
                rows.append(row)
                print(_line(row), flush=True)
            engine.shutdown()
    print()
    print(table(rows))
    if args.json:
        meta = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": meta, "rows": rows}, f, indent=1)


def _warm_up(engine) -> None:
    """A few steps outside the measurement (first-call costs), then an empty cache."""
    from radixrt import SamplingParams

    engine.generate(
        prompt_token_ids=[[11 + i for i in range(24)]],
        sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    )
    engine.cache.reset()


def _line(r: dict) -> str:
    return (
        f"{r['workload']:>15} {r['method']:>5} pass {r['run']}: {r['steps']} steps, "
        f"{r['tok_per_s']:.0f} tok/s, {r['tok_per_cpu_s']:.0f} tok/cpu-s, "
        f"fired {r['fire_rate']:.0%}, "
        f"accepted {r['acceptance_rate']:.0%}, same outputs {r['same_outputs']}"
    )


def table(rows: list[dict]) -> str:
    """Markdown: one row per (workload, pass, method), speedups (tokens per CPU second)
    against none."""
    base = {(r["workload"], r["run"]): r for r in rows if r["method"] == "none"}
    out = [
        "| workload | pass | method | steps | tok/s | tok/cpu-s | speedup | fired | drafted "
        "| accepted "
        "| acceptance | tokens / verify | same outputs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get((r["workload"], r["run"]))
        speedup = f"{r['tok_per_cpu_s'] / b['tok_per_cpu_s']:.2f}x" if b else "-"
        if r["method"] == "none":
            spec = ["-"] * 5
        else:
            spec = [
                f"{r['fire_rate']:.0%}",
                str(r["spec_draft_tokens"]),
                str(r["spec_accepted_tokens"]),
                f"{r['acceptance_rate']:.0%}",
                f"{r['mean_acceptance_length']:.2f}",
            ]
        cells = [r["workload"], r["run"], r["method"], r["steps"], f"{r['tok_per_s']:.0f}"]
        cells.append(f"{r['tok_per_cpu_s']:.0f}")
        cells += [speedup, *spec, "yes" if r["same_outputs"] else "NO"]
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
