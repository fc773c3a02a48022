"""Multi-turn chat: every turn re-sends the conversation, the prefix cache reuses it.

python -m radixrt.frontend.examples.chat [--model DIR | --url URL]
"""

from __future__ import annotations

from collections.abc import Sequence

from radixrt.frontend import ProgramState, assistant, function, gen, system, user

from .common import cache_report, make_backend, parse_args

QUESTIONS = (
    "Hello! Who are you?",
    "What can you help me with?",
    "Summarize our conversation in one sentence.",
)


@function
def multi_turn_chat(s, questions: Sequence[str], max_tokens: int) -> None:
    s += system("You are a helpful assistant. Answer briefly.")
    for i, question in enumerate(questions):
        s += user(question)
        s += assistant(gen(f"answer_{i}", max_tokens=max_tokens))


def main(argv: Sequence[str] | None = None) -> ProgramState:
    args = parse_args(__doc__, argv, lambda p: p.add_argument("--turns", type=int, default=3))
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.turns)]
    with make_backend(args) as backend:
        state = multi_turn_chat.run(
            questions=questions,
            max_tokens=args.max_tokens,
            backend=backend,
            gen_defaults={"temperature": args.temperature},
        )
        for i, question in enumerate(questions):
            meta = state.meta(f"answer_{i}")
            print(f"user: {question}")
            print(f"assistant: {state[f'answer_{i}']!r}")
            print(f"  ({meta['prompt_tokens']} prompt tokens, {meta['cached_tokens']} cached)")
        print(cache_report(backend))
    return state


if __name__ == "__main__":
    main()
