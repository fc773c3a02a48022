"""Few-shot programs: MMLU-style 5-shot (one decoded token) and HellaSwag-style 20-shot
select over 4 endings. Both share long few-shot headers across many short questions."""

from __future__ import annotations

from radixrt.frontend import function, select

from .base import PlainLLM, ProgramSpec
from .text import Words, forced, seeded

LETTERS = "ABCD"


def _mmlu_question(words: Words, rng, p: dict, answer: str | None) -> str:
    text = "Question:" + words.text(rng, p["question_len"])
    for letter in LETTERS:
        text += f"\n{letter}." + words.text(rng, p["option_len"])
    return text + "\nAnswer:" + (f" {answer}\n\n" if answer else "")


def mmlu_inputs(words: Words, seed: int, p: dict, index: int) -> dict:
    subject = index % p["num_subjects"]
    rng = seeded(seed, "mmlu-subject", subject)
    header = "The following are multiple choice questions about" + words.text(rng, 3) + ".\n\n"
    for _ in range(p["num_shots"]):
        header += _mmlu_question(words, rng, p, LETTERS[int(rng.integers(4))])
    rng = seeded(seed, "mmlu-question", index)
    return {
        "header": header,
        "question": _mmlu_question(words, rng, p, None),
        "token": words.token(rng),
    }


@function
def mmlu(s, header: str, question: str, token: int) -> None:
    s += header + question + forced("answer", 1, token)


async def mmlu_plain(llm: PlainLLM, header: str, question: str, token: int) -> None:
    await llm.gen(header + question, 1, token)


def hellaswag_inputs(words: Words, seed: int, p: dict, index: int) -> dict:
    rng = seeded(seed, "hellaswag-shots")
    shots = "".join(
        "Context:" + words.text(rng, p["context_len"]) + "\nEnding:"
        + words.text(rng, p["ending_len"]) + "\n\n"
        for _ in range(p["num_shots"])
    )  # fmt: skip
    rng = seeded(seed, "hellaswag-question", index)
    return {
        "shots": shots,
        "context": words.text(rng, p["context_len"]),
        "endings": [words.text(rng, p["ending_len"]) for _ in range(4)],
    }


@function
def hellaswag(s, shots: str, context: str, endings: list[str]) -> None:
    s += shots + "Context:" + context + "\nEnding:"
    s += select("ending", endings)


async def hellaswag_plain(llm: PlainLLM, shots: str, context: str, endings: list[str]) -> None:
    await llm.select(shots + "Context:" + context + "\nEnding:", endings)


PROGRAMS = [
    ProgramSpec(
        "mmlu",
        "5-shot multiple choice per subject, one decoded token per question",
        mmlu,
        mmlu_plain,
        mmlu_inputs,
        {
            "smoke": dict(
                num_programs=12, num_subjects=2, num_shots=5, question_len=16, option_len=4
            ),
            "full": dict(
                num_programs=384, num_subjects=8, num_shots=5, question_len=60, option_len=12
            ),
        },  # fmt: skip
        fork_heavy=False,
    ),
    ProgramSpec(
        "hellaswag",
        "20-shot context, select one of 4 endings by log-prob",
        hellaswag,
        hellaswag_plain,
        hellaswag_inputs,
        {
            "smoke": dict(num_programs=8, num_shots=20, context_len=6, ending_len=4),
            "full": dict(num_programs=256, num_shots=20, context_len=40, ending_len=16),
        },
        fork_heavy=False,
    ),
]
