"""Agent programs: a ReAct agent (thought / action / observation on a growing context) and
generative-agent calls (many independent calls on one agent's long description)."""

from __future__ import annotations

from radixrt.frontend import function

from .base import PlainLLM, ProgramSpec
from .text import Words, forced, seeded


def react_inputs(words: Words, seed: int, p: dict, index: int) -> dict:
    shared = seeded(seed, "react-system")
    rng = seeded(seed, "react-agent", index)
    steps = [
        {
            "thought": words.token(rng),
            "action": words.token(rng),
            "observation": words.text(rng, p["observation_len"]),
        }
        for _ in range(p["num_steps"])
    ]
    return {
        "system": "Answer the question with tools." + words.text(shared, p["system_len"]),
        "question": words.text(rng, p["question_len"]),
        "steps": steps,
        "lens": [p["thought_len"], p["action_len"], p["answer_len"]],
        "answer": words.token(rng),
    }


@function
def react(s, system: str, question: str, steps: list, lens: list, answer: int) -> None:
    thought_len, action_len, answer_len = lens
    s += system + "\nQuestion:" + question + "\n"
    for step in steps:
        s += "Thought:" + forced(None, thought_len, step["thought"])
        s += "\nAction:" + forced(None, action_len, step["action"])
        s += "\nObservation:" + step["observation"] + "\n"
    s += "Answer:" + forced("answer", answer_len, answer)


async def react_plain(
    llm: PlainLLM, system: str, question: str, steps: list, lens: list, answer: int
) -> None:
    thought_len, action_len, answer_len = lens
    prompt = system + "\nQuestion:" + question + "\n"
    for step in steps:
        prompt += "Thought:"
        prompt += await llm.gen(prompt, thought_len, step["thought"])
        prompt += "\nAction:"
        prompt += await llm.gen(prompt, action_len, step["action"])
        prompt += "\nObservation:" + step["observation"] + "\n"
    await llm.gen(prompt + "Answer:", answer_len, answer)


def agent_inputs(words: Words, seed: int, p: dict, index: int) -> dict:
    rng = seeded(seed, "gen-agent", index)
    identity = "You are" + words.text(rng, p["identity_len"]) + "\n"
    calls = [
        {
            "memories": words.text(rng, p["memory_len"]),
            "query": words.text(rng, p["query_len"]),
            "token": words.token(rng),
        }
        for _ in range(p["num_calls"])
    ]
    return {"identity": identity, "calls": calls, "output_len": p["output_len"]}


def _agent_prompt(call: dict) -> str:
    return "Relevant memories:" + call["memories"] + "\nQuestion:" + call["query"] + "\nAnswer:"


@function
def gen_agent(s, identity: str, calls: list, output_len: int) -> None:
    s += identity
    for call in calls:  # each call continues the agent's description, not the last call
        branch = s.fork(1)
        branch[0] += _agent_prompt(call) + forced("answer", output_len, call["token"])
        branch.join()


async def gen_agent_plain(llm: PlainLLM, identity: str, calls: list, output_len: int) -> None:
    for call in calls:
        await llm.gen(identity + _agent_prompt(call), output_len, call["token"])


PROGRAMS = [
    ProgramSpec(
        "react",
        "ReAct agent: thought, action, observation steps on a growing context",
        react,
        react_plain,
        react_inputs,
        {
            "smoke": dict(
                num_programs=4,
                system_len=80,
                question_len=12,
                num_steps=3,
                thought_len=6,
                action_len=3,
                observation_len=12,
                answer_len=4,
            ),
            "full": dict(
                num_programs=48,
                system_len=900,
                question_len=60,
                num_steps=6,
                thought_len=48,
                action_len=12,
                observation_len=120,
                answer_len=32,
            ),
        },  # fmt: skip
        fork_heavy=False,
    ),
    ProgramSpec(
        "gen-agents",
        "generative agents: one agent's description, then calls on different memories",
        gen_agent,
        gen_agent_plain,
        agent_inputs,
        {
            "smoke": dict(
                num_programs=4,
                identity_len=60,
                num_calls=3,
                memory_len=12,
                query_len=6,
                output_len=4,
            ),
            "full": dict(
                num_programs=32,
                identity_len=600,
                num_calls=8,
                memory_len=150,
                query_len=30,
                output_len=40,
            ),
        },  # fmt: skip
        fork_heavy=False,
    ),
]
