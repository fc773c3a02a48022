"""SmolLM2-135M-Instruct on a CPU (its pinned GGUF file, float32): radixrt against HF
transformers' `generate` on the same file, paired in one process, and the radix cache against
no cache over a 5-turn chat.

    taskset -c 0 python -m benchmarks.bench_smollm2_cpu --rounds 5 --threads 1

- batch: 16 chat prompts x 64 new tokens (greedy, EOS ignored); HF runs them as one
  left-padded batch, radixrt as 16 requests. Each round runs both, alternating which goes
  first; prints out tok/s per round and the median of the per-round ratios.
- single: one prompt x 64 new tokens, the same pairing.
- chat: 5 turns of one conversation through the in-process engine, the answers fed back, with
  `prefix_cache="radix"` and with `"none"`, alternating per round: prompt tokens computed and
  the median wall time. One engine at a time: with two CPU engines alive in one process the
  first one's steps ran 1.7-5x slower (not understood yet).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "Give me three tips for better sleep.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and German.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is 17 times 23?",
    "Name three planets and one fact about each.",
    "Why is the sky blue?",
    "Suggest a name for a friendly robot.",
    "What is the difference between weather and climate?",
    "Write a short thank-you note to a teacher.",
    "How many legs does a spider have?",
    "What does HTTP stand for?",
]
CHAT_TURNS = [
    "Hi! Can you help me plan a small garden?",
    "I have a sunny balcony. Which vegetables grow well in pots?",
    "How often should I water tomatoes?",
    "What about basil? Can it share a pot with them?",
    "Great. Give me a short weekly checklist.",
]
NEW_TOKENS = 64


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (both)")
    p.add_argument("--parts", default="batch,single,chat")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    torch.set_num_threads(args.threads)

    import transformers

    from radixrt import Engine, SamplingParams
    from radixrt.hf_dir.smollm2 import fetch_smollm2

    path = fetch_smollm2()
    folder, name = os.path.split(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()

    def engine(prefix_cache: str = "radix") -> Engine:
        return Engine(path, device="cpu", dtype="float32", cpu_threads=args.threads,
                      prefix_cache=prefix_cache, freeze_gc=True, num_kv_blocks=512)  # fmt: skip

    rt = engine()

    def chat_ids(messages: list[dict]) -> list[int]:
        text = rt.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return rt.tokenizer.encode(text, add_special_tokens=False)

    prompts = [chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

    def run_hf(batch: list[list[int]]) -> float:
        width = max(map(len, batch))
        pad = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(q)) + q for q in batch])
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in batch])
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,  # EOS ignored
                do_sample=False,
                pad_token_id=pad,
            )
        elapsed = time.perf_counter() - start
        assert out.shape == (len(batch), width + NEW_TOKENS)
        return len(batch) * NEW_TOKENS / elapsed

    def run_rt(batch: list[list[int]]) -> float:
        start = time.perf_counter()
        outs = rt.generate(prompt_token_ids=batch, sampling_params=greedy)
        elapsed = time.perf_counter() - start
        assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
        rt.cache.reset()  # every round computes its prompts
        return len(batch) * NEW_TOKENS / elapsed

    run_hf(prompts[:2])
    run_rt(prompts[:2])  # warm-up
    cases = {"batch": ("batch 16 x 64", prompts), "single": ("single 1 x 64", prompts[:1])}
    for label, batch in [cases[part] for part in parts if part in cases]:
        rows = []
        for r in range(args.rounds):
            if r % 2 == 0:
                hf_tps, rt_tps = run_hf(batch), run_rt(batch)
            else:
                rt_tps = run_rt(batch)
                hf_tps = run_hf(batch)
            rows.append((hf_tps, rt_tps))
            ratio, load = rt_tps / hf_tps, os.getloadavg()[0]
            print(
                f"{label} round {r + 1}: HF {hf_tps:.1f} out tok/s, radixrt {rt_tps:.1f} "
                f"({ratio:.2f}x), load {load:.2f}",
                flush=True,
            )
        ratios = [t / h for h, t in rows]
        hf_med = statistics.median(h for h, _ in rows)
        rt_med = statistics.median(t for _, t in rows)
        print(
            f"{label}: median HF {hf_med:.1f}, radixrt {rt_med:.1f} out tok/s; per-round ratio "
            f"median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, "
            f"max {max(ratios):.2f})"
        )
    rt.shutdown()  # (its tokenizer still renders the chat below)
    if "chat" not in parts:
        return
    walls: dict[str, list[float]] = {"radix": [], "none": []}
    for r in range(args.rounds):  # alternating which goes first, as above
        for prefix_cache in ("radix", "none") if r % 2 == 0 else ("none", "radix"):
            chat = engine(prefix_cache)  # one engine at a time (see the module docstring)
            messages, computed, start = [], 0, time.perf_counter()
            for turn in CHAT_TURNS:
                messages.append({"role": "user", "content": turn})
                out = chat.generate(prompt_token_ids=[chat_ids(messages)], sampling_params=greedy)[
                    0
                ]
                computed += out.prompt_tokens - out.num_cached_tokens
                messages.append({"role": "assistant", "content": out.text})
            walls[prefix_cache].append(time.perf_counter() - start)
            chat.shutdown()
            print(
                f"5-turn chat round {r + 1}, prefix_cache={prefix_cache}: {computed} prompt "
                f"tokens computed, {walls[prefix_cache][-1]:.1f} s",
                flush=True,
            )
    for prefix_cache, times in walls.items():
        print(f"5-turn chat, prefix_cache={prefix_cache}: median {statistics.median(times):.1f} s")


if __name__ == "__main__":
    main()
