"""Branching programs: tree of thought (branch, score, expand the best), skeleton of thought
(fork N points, expand in parallel, join) and an LLM judge (branch-solve-merge). The branch
kept at each tree level is scripted, so every configuration expands the same nodes."""

from __future__ import annotations

from radixrt.frontend import function, select

from .base import PlainLLM, ProgramSpec
from .text import Words, forced, seeded

SCORE_CHOICES = [" yes", " no"]


def tot_inputs(words: Words, seed: int, p: dict, index: int) -> dict:
    shared = seeded(seed, "tot-system")
    rng = seeded(seed, "tot", index)
    b, d = p["branches"], p["depth"]
    return {
        "system": "Solve the problem step by step." + words.text(shared, p["system_len"]),
        "question": words.text(rng, p["question_len"]),
        "tokens": [[words.token(rng) for _ in range(b)] for _ in range(d)],
        "best": [int(rng.integers(b)) for _ in range(d)],
        "lens": [p["step_len"], p["answer_len"]],
        "answer": words.token(rng),
    }


@function
def tot(s, system: str, question: str, tokens: list, best: list, lens: list, answer: int):
    step_len, answer_len = lens
    s += system + "\nProblem:" + question + "\n"
    for level, (level_tokens, keep) in enumerate(zip(tokens, best)):
        forks = s.fork(len(level_tokens))
        for branch, token in zip(forks, level_tokens):
            branch += f"Step {level + 1}:" + forced("step", step_len, token)
            branch += "\nIs this step correct? Answer:" + select("ok", SCORE_CHOICES)
        forks.join()
        s += f"Step {level + 1}:" + forks[keep]["step"] + "\n"
    s += "Answer:" + forced("answer", answer_len, answer)


async def tot_plain(
    llm: PlainLLM, system: str, question: str, tokens: list, best: list, lens: list, answer: int
) -> None:
    step_len, answer_len = lens
    prompt = system + "\nProblem:" + question + "\n"

    async def branch(level: int, token: int) -> str:
        head = prompt + f"Step {level + 1}:"
        step = await llm.gen(head, step_len, token)
        await llm.select(head + step + "\nIs this step correct? Answer:", SCORE_CHOICES)
        return step

    for level, (level_tokens, keep) in enumerate(zip(tokens, best)):
        steps = await llm.all([branch(level, t) for t in level_tokens])
        prompt += f"Step {level + 1}:" + steps[keep] + "\n"
    await llm.gen(prompt + "Answer:", answer_len, answer)


def sot_inputs(words: Words, seed: int, p: dict, index: int) -> dict:
    shared = seeded(seed, "sot-system")
    rng = seeded(seed, "sot", index)
    num_points = int(rng.integers(p["min_points"], p["max_points"] + 1))
    return {
        "system": "Answer with a skeleton, then expand each point."
        + words.text(shared, p["system_len"]),
        "question": words.text(rng, p["question_len"]),
        "skeleton": words.token(rng),
        "points": [words.token(rng) for _ in range(num_points)],
        "lens": [p["skeleton_len"], p["point_len"]],
    }


@function
def sot(s, system: str, question: str, skeleton: int, points: list, lens: list) -> None:
    skeleton_len, point_len = lens
    s += system + "\nQuestion:" + question + "\nSkeleton:"
    s += forced("skeleton", skeleton_len, skeleton)
    forks = s.fork(len(points))
    for i, (branch, token) in enumerate(zip(forks, points)):
        branch += f"\nExpand point {i + 1}:" + forced("point", point_len, token)
    forks.join()


async def sot_plain(
    llm: PlainLLM, system: str, question: str, skeleton: int, points: list, lens: list
) -> None:
    skeleton_len, point_len = lens
    prompt = system + "\nQuestion:" + question + "\nSkeleton:"
    prompt += await llm.gen(prompt, skeleton_len, skeleton)
    await llm.all(
        [llm.gen(prompt + f"\nExpand point {i + 1}:", point_len, t) for i, t in enumerate(points)]
    )


def judge_inputs(words: Words, seed: int, p: dict, index: int) -> dict:
    shared = seeded(seed, "judge-system")
    criteria = [words.text(shared, p["criterion_len"]) for _ in range(p["num_criteria"])]
    rng = seeded(seed, "judge", index)
    return {
        "system": "Judge the answer to the question." + words.text(shared, p["system_len"]),
        "question": words.text(rng, p["question_len"]),
        "response": words.text(rng, p["response_len"]),
        "criteria": criteria,
        "tokens": [words.token(rng) for _ in criteria],
        "verdict": words.token(rng),
        "lens": [p["judgement_len"], p["verdict_len"]],
    }


def _judge_head(system: str, question: str, response: str) -> str:
    return system + "\nQuestion:" + question + "\nAnswer:" + response + "\n"


@function
def judge(s, system, question, response, criteria, tokens, verdict, lens) -> None:
    judgement_len, verdict_len = lens
    s += _judge_head(system, question, response)
    forks = s.fork(len(criteria))
    for branch, criterion, token in zip(forks, criteria, tokens):
        branch += "Criterion:" + criterion + "\nJudgement:"
        branch += forced("judgement", judgement_len, token)
    forks.join()
    for criterion, text in zip(criteria, forks["judgement"]):
        s += "Criterion:" + criterion + "\nJudgement:" + text + "\n"
    s += "Verdict:" + forced("verdict", verdict_len, verdict)


async def judge_plain(llm: PlainLLM, system, question, response, criteria, tokens, verdict, lens):
    judgement_len, verdict_len = lens
    head = _judge_head(system, question, response)
    texts = await llm.all(
        [
            llm.gen(head + "Criterion:" + c + "\nJudgement:", judgement_len, t)
            for c, t in zip(criteria, tokens)
        ]
    )
    for criterion, text in zip(criteria, texts):
        head += "Criterion:" + criterion + "\nJudgement:" + text + "\n"
    await llm.gen(head + "Verdict:", verdict_len, verdict)


PROGRAMS = [
    ProgramSpec(
        "tree-of-thought",
        "fork b candidate steps, score each with select, keep one, d levels, answer",
        tot,
        tot_plain,
        tot_inputs,
        {
            "smoke": dict(
                num_programs=3,
                system_len=30,
                question_len=12,
                branches=2,
                depth=2,
                step_len=6,
                answer_len=4,
            ),
            "full": dict(
                num_programs=64,
                system_len=300,
                question_len=200,
                branches=3,
                depth=3,
                step_len=64,
                answer_len=32,
            ),
        },  # fmt: skip
        fork_heavy=True,
    ),
    ProgramSpec(
        "skeleton-of-thought",
        "skeleton, then fork N points expanded in parallel, join",
        sot,
        sot_plain,
        sot_inputs,
        {
            "smoke": dict(
                num_programs=3,
                system_len=30,
                question_len=10,
                skeleton_len=6,
                min_points=3,
                max_points=3,
                point_len=8,
            ),
            "full": dict(
                num_programs=48,
                system_len=200,
                question_len=80,
                skeleton_len=48,
                min_points=4,
                max_points=8,
                point_len=160,
            ),
        },  # fmt: skip
        fork_heavy=True,
    ),
    ProgramSpec(
        "llm-judge",
        "branch-solve-merge: judge one answer on k criteria in parallel, merge a verdict",
        judge,
        judge_plain,
        judge_inputs,
        {
            "smoke": dict(
                num_programs=3,
                system_len=20,
                question_len=10,
                response_len=30,
                num_criteria=3,
                criterion_len=4,
                judgement_len=6,
                verdict_len=4,
            ),
            "full": dict(
                num_programs=32,
                system_len=150,
                question_len=100,
                response_len=500,
                num_criteria=5,
                criterion_len=20,
                judgement_len=128,
                verdict_len=32,
            ),
        },  # fmt: skip
        fork_heavy=True,
    ),
]
