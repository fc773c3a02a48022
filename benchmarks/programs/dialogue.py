"""JSON extraction under a schema, and multi-turn chat with short or long answers."""

from __future__ import annotations

import json

from radixrt.frontend import assistant, function, gen, system, user

from .base import PlainLLM, ProgramSpec
from .text import Words, forced, seeded

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "city": {"type": "string", "maxLength": 12},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    },
    "required": ["name", "city", "year"],
    "additionalProperties": False,
}


def json_inputs(words: Words, seed: int, p: dict, index: int) -> dict:
    shared = seeded(seed, "json-system")
    rng = seeded(seed, "json", index)
    return {
        "system": "Extract the fields as JSON: "
        + json.dumps(SCHEMA)
        + words.text(shared, p["system_len"]),
        "document": words.text(rng, p["document_len"]),
        "max_tokens": p["max_tokens"],
    }


@function
def json_extract(s, system: str, document: str, max_tokens: int) -> None:
    s += system + "\nDocument:" + document + "\nJSON:"
    s += gen("json", max_tokens=max_tokens, temperature=0, json_schema=SCHEMA)


async def json_extract_plain(llm: PlainLLM, system: str, document: str, max_tokens: int):
    await llm.gen_json(system + "\nDocument:" + document + "\nJSON:", SCHEMA, max_tokens)


def chat_inputs(words: Words, seed: int, p: dict, index: int) -> dict:
    shared = seeded(seed, "chat-system", p["output_len"])
    rng = seeded(seed, "chat", p["output_len"], index)
    return {
        "system_prompt": "You are a helpful assistant." + words.text(shared, p["system_len"]),
        "turns": [
            {"user": words.text(rng, p["user_len"]), "token": words.token(rng)}
            for _ in range(p["num_turns"])
        ],
        "output_len": p["output_len"],
    }


@function
def chat(s, system_prompt: str, turns: list, output_len: int) -> None:
    s += system(system_prompt)
    for i, turn in enumerate(turns):
        s += user(turn["user"])
        s += assistant(forced(f"answer_{i}", output_len, turn["token"]))


async def chat_plain(llm: PlainLLM, system_prompt: str, turns: list, output_len: int) -> None:
    messages = [{"role": "system", "content": system_prompt}]
    for turn in turns:
        messages.append({"role": "user", "content": turn["user"]})
        answer = await llm.chat(messages, output_len, turn["token"])
        messages.append({"role": "assistant", "content": answer})


def _chat_sizes(output_small: int, output_full: int, users_full: int, turns_full: int) -> dict:
    return {
        "smoke": dict(num_programs=4, system_len=30, num_turns=3, user_len=10,
                      output_len=output_small),
        "full": dict(num_programs=users_full, system_len=300, num_turns=turns_full,
                     user_len=80, output_len=output_full),
    }  # fmt: skip


PROGRAMS = [
    ProgramSpec(
        "json",
        "extract fields from a document as JSON under a schema (constrained decoding)",
        json_extract,
        json_extract_plain,
        json_inputs,
        {
            "smoke": dict(num_programs=4, system_len=20, document_len=40, max_tokens=24),
            "full": dict(num_programs=96, system_len=200, document_len=600, max_tokens=64),
        },
        fork_heavy=False,
    ),
    ProgramSpec(
        "chat-short",
        "multi-turn chat, short answers",
        chat,
        chat_plain,
        chat_inputs,
        _chat_sizes(4, 32, 72, 6),
        fork_heavy=False,
    ),
    ProgramSpec(
        "chat-long",
        "multi-turn chat, long answers",
        chat,
        chat_plain,
        chat_inputs,
        _chat_sizes(16, 256, 40, 4),
        fork_heavy=False,
    ),
]
