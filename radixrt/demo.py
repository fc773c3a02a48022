"""`radixrt demo`: what the runtime does, on SmolLM2-135M-Instruct (or the tiny model), in
four checks, after a question with a known answer.

What each section prints about the runtime is measured, and its checks hold by construction
whatever the text; on SmolLM2 the demo also checks one answer (it names Paris):

1. prefix cache: a multi-turn chat with the radix cache, then the same prompts with the cache
   emptied before each: the tokens reused, the time, and whether the texts are identical
   (greedy decoding: they must be).
2. a forked program (radixrt.frontend): branches of one prompt, its KV shared by the forks.
3. constrained JSON: output under a JSON schema, parsed back and checked.
4. n > 1: several samples of one prompt, its prefix computed once.
"""

from __future__ import annotations

import json
import time
from typing import Any

CHAT_SYSTEM = "You are a helpful assistant. Answer briefly and kindly."
CHAT_TURNS = ("Hello! Who are you?", "What is the weather like?", "Tell me a story.")
FORK_PROMPT = "Tell me a story about a fox."
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SAMPLES_PROMPT = "Once upon a time"
FACT_QUESTION, FACT_ANSWER = "What is the capital of France?", "Paris"
# KV blocks of the demo's pool: its prompts and answers fit many times over, and the process
# stays small (the default pool is sized for serving)
DEMO_KV_BLOCKS = 64


def run_demo(
    engine: Any, max_tokens: int, model_line: str | None, check_fact: bool = False
) -> dict[str, bool]:
    """Print the four sections on `engine` (an `radixrt.Engine`; its cache is emptied in
    section 1) and return each section's check: {"cache_identical", "fork_shared",
    "json_valid", "n_prompt_shared"}, and "fact_right" first with `check_fact` (a real
    model: its greedy answer to FACT_QUESTION names FACT_ANSWER)."""
    from radixrt import SamplingParams

    if model_line:
        print(f"model: {model_line}")
    print("(the text is the model's; the lines about the runtime are measured)\n")
    checks = {}
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0)
    tok = engine.tokenizer
    if check_fact:
        print(f"== a question with a known answer ==\nuser: {FACT_QUESTION}")
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": FACT_QUESTION}], add_generation_prompt=True, tokenize=False
        )
        answer = engine.generate([prompt], greedy)[0].text
        checks["fact_right"] = FACT_ANSWER in answer
        said = "yes" if checks["fact_right"] else "NO"
        print(f"assistant: {answer!r}\nnames {FACT_ANSWER}: {said}\n")

    print(f"== 1. prefix cache: a {len(CHAT_TURNS)}-turn chat, radix cache vs no cache ==")
    messages = [{"role": "system", "content": CHAT_SYSTEM}]
    turns = []
    for question in CHAT_TURNS:
        messages.append({"role": "user", "content": question})
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        t0 = time.perf_counter()
        out = engine.generate([prompt], greedy)[0]
        turns.append((question, prompt, out, time.perf_counter() - t0))
        messages.append({"role": "assistant", "content": out.text})
    identical = True
    for i, (question, prompt, out, dt) in enumerate(turns, 1):
        engine.cache.reset()  # the no-cache run: nothing to reuse
        t0 = time.perf_counter()
        cold = engine.generate([prompt], greedy)[0]
        cold_dt = time.perf_counter() - t0
        same = cold.token_ids == out.token_ids
        identical &= same and cold.num_cached_tokens == 0
        print(f"turn {i}: user: {question}")
        print(f"        assistant: {out.text!r}")
        print(
            f"        radix: {out.num_cached_tokens}/{out.prompt_tokens} prompt tokens reused, "
            f"{dt * 1e3:.0f} ms | no cache: 0 reused, {cold_dt * 1e3:.0f} ms | "
            f"same tokens: {'yes' if same else 'NO'}"
        )
    checks["cache_identical"] = identical

    print("\n== 2. a forked program: three stories from one prompt ==")
    checks["fork_shared"] = _forked_program(engine, max_tokens)

    print("\n== 3. constrained JSON (a schema: name <= 12 chars, age 0-120) ==")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=64, temperature=0, json_schema=PERSON_SCHEMA)
    )[0]
    valid = _matches_person_schema(out.text)
    print(f"  {out.text}")
    print(f"  parses and matches the schema: {'yes' if valid else 'NO'}")
    checks["json_valid"] = valid

    n = 4
    print(f"\n== 4. n = {n} samples of {SAMPLES_PROMPT!r} (temperature 0.9) ==")
    engine.cache.reset()  # the prompt is computed here, not found in the cache
    before = engine.stats()
    outs = engine.generate(
        [SAMPLES_PROMPT], SamplingParams(n=n, max_tokens=max_tokens, temperature=0.9, seed=1)
    )
    after = engine.stats()
    for o in outs:
        print(f"  sample {o.index}: {o.text!r}")
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    prompt_len = outs[0].prompt_tokens
    print(
        f"  prompt tokens computed: {computed} for {n} samples of a {prompt_len}-token prompt "
        f"(the prefix once, each sample's last prompt token; {n * prompt_len} unshared)"
    )
    checks["n_prompt_shared"] = len(outs) == n and computed < n * prompt_len

    stats = engine.stats()
    print(
        f"\ncache hit rate {stats['cache_hit_rate']:.1%} "
        f"({stats['cached_tokens']}/{stats['prompt_tokens']} prompt tokens), "
        f"{stats['steps']} steps; checks: "
        + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items())
    )
    engine.check_integrity()
    return checks


def _forked_program(engine: Any, max_tokens: int) -> bool:
    """Run a frontend program that forks three branches after a shared prompt; print them and
    return whether the branches' prompt came from the cache (computed once)."""
    from radixrt.frontend import EngineBackend, function, gen, system, user

    texts: list[str] = []

    @function
    def stories(s, n: int) -> None:
        s += system(CHAT_SYSTEM)
        s += user(FORK_PROMPT)
        with s.assistant():
            forks = s.fork(n)
            for i, branch in enumerate(forks):
                branch += gen("story", max_tokens=max_tokens, temperature=0.8, seed=i)
            forks.join()
            texts.extend(branch["story"] for branch in forks)

    before = engine.stats()
    backend = EngineBackend(engine)
    try:
        stories.run(n=3, backend=backend)
    finally:
        backend.close()  # the engine stays usable
    after = engine.stats()
    for i, text in enumerate(texts):
        print(f"  branch {i}: {text!r}")
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    print(f"  prompt tokens of the program's calls: {prompt}, {cached} of them from the cache")
    return cached > 0


def _matches_person_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 12
        and type(value["age"]) is int
        and 0 <= value["age"] <= 120
    )
