"""Tree of thought: at each level fork candidate next steps, let the model rate each one
with select, keep the best, and go deeper. Branches share the prompt's KV via the cache.

    python -m radixrt.frontend.examples.tree_of_thought [--model DIR | --url URL]
"""

from __future__ import annotations

from collections.abc import Sequence

from radixrt.frontend import ProgramState, function, gen, select, system, user

from .common import cache_report, make_backend, parse_args


@function
def tree_of_thought(
    s, question: str, branches: int, depth: int, max_tokens: int, temperature: float
) -> None:
    s += system("Solve the problem one step at a time. Write one step per line.")
    s += user(question)
    with s.assistant():
        for level in range(1, depth + 1):
            forks = s.fork(branches)
            for i, branch in enumerate(forks):
                branch += f"Step {level}:" + gen(
                    "step", max_tokens=max_tokens, stop="\n", temperature=temperature, seed=i
                )
                branch += "\nIs this step correct? Answer:" + select("ok", [" yes", " no"])
            forks.join()
            values = [branch.meta("ok")["scores"][0] for branch in forks]  # log p(" yes")
            best = max(range(branches), key=values.__getitem__)
            s += f"Step {level}:{forks[best]['step']}\n"
        s += "Answer:" + gen("answer", max_tokens=max_tokens, stop="\n")


def main(argv: Sequence[str] | None = None) -> ProgramState:
    def options(p):
        p.add_argument("--branches", type=int, default=3)
        p.add_argument("--depth", type=int, default=2)
        p.add_argument("--question", default="A train goes 60 km in 45 minutes. Speed in km/h?")

    args = parse_args(__doc__, argv, options)
    with make_backend(args) as backend:
        state = tree_of_thought.run(
            question=args.question,
            branches=args.branches,
            depth=args.depth,
            max_tokens=args.max_tokens,
            temperature=args.temperature or 0.8,  # branches need diversity
            backend=backend,
        )
        print(state.messages()[-1]["content"])
        print(cache_report(backend))
    return state


if __name__ == "__main__":
    main()
