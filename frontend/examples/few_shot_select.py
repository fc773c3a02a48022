"""Few-shot multiple choice with select, run as a batch that shares the few-shot prefix.

python -m radixrt.frontend.examples.few_shot_select [--model DIR | --url URL]
"""

from __future__ import annotations

from collections.abc import Sequence

from radixrt.frontend import ProgramState, function, select

from .common import cache_report, make_backend, parse_args

LETTERS = ("A", "B", "C", "D")
SHOTS = (
    ("What is the capital of France?", ("Berlin", "Paris", "Rome", "Madrid"), "B"),
    ("How many legs does a spider have?", ("Six", "Four", "Eight", "Ten"), "C"),
    ("Which planet is closest to the sun?", ("Mercury", "Venus", "Earth", "Mars"), "A"),
)
QUESTIONS = (
    ("What is 7 * 8?", ("54", "56", "64", "48"), "B"),
    ("Which gas do plants absorb?", ("Oxygen", "Helium", "Nitrogen", "Carbon dioxide"), "D"),
    ("What colour is a clear daytime sky?", ("Blue", "Green", "Red", "Black"), "A"),
    ("How many days are in a leap year?", ("365", "364", "366", "360"), "C"),
)


def format_question(question: str, options: Sequence[str]) -> str:
    lines = [f"Question: {question}"] + [f"{k}. {o}" for k, o in zip(LETTERS, options)]
    return "\n".join(lines) + "\nAnswer:"


FEW_SHOT_PREFIX = "".join(f"{format_question(q, o)} {a}\n\n" for q, o, a in SHOTS)


@function
def multiple_choice(s, question: str, options: Sequence[str]) -> None:
    s += FEW_SHOT_PREFIX
    s += format_question(question, options)
    s += select("answer", choices=[" " + k for k in LETTERS[: len(options)]])


def main(argv: Sequence[str] | None = None) -> list[ProgramState]:
    def options(p):
        p.add_argument("--num-questions", type=int, default=len(QUESTIONS))

    args = parse_args(__doc__, argv, options)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_questions)]
    with make_backend(args) as backend:
        states = multiple_choice.run_batch(
            [{"question": q, "options": o} for q, o, _ in questions],
            backend=backend,
            progress_bar=True,
        )
        correct = 0
        for (question, _, answer), state in zip(questions, states):
            picked = state["answer"].strip()
            correct += picked == answer
            print(f"{question:45s} picked {picked} (answer {answer})")
        print(f"accuracy {correct}/{len(questions)}")
        print(cache_report(backend))
    return states


if __name__ == "__main__":
    main()
