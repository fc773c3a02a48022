"""What a program of the suite is: a DSL function, the same program written without the DSL,
and its seeded inputs at two sizes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from radixrt.frontend import Program

from .text import Words


class PlainLLM(Protocol):
    """The calls a program makes without the DSL (an OpenAI client underneath). `all` runs
    a program's independent branches: one after another (a plain loop) or concurrently."""

    async def gen(self, prompt: str, max_tokens: int, token: int) -> str: ...
    async def chat(self, messages: list[dict], max_tokens: int, token: int) -> str: ...
    async def gen_json(self, prompt: str, schema: dict, max_tokens: int) -> str: ...
    async def select(self, prompt: str, choices: Sequence[str]) -> int: ...
    async def all(self, branches: Sequence[Awaitable[Any]]) -> list[Any]: ...


@dataclass(frozen=True)
class ProgramSpec:
    name: str
    shape: str  # one line: what the program does, as in the reference study's workload
    dsl: Program  # dsl.run(**inputs)
    plain: Callable[..., Awaitable[None]]  # await plain(llm, **inputs)
    make_inputs: Callable[[Words, int, dict, int], dict]  # (words, seed, size, index)
    # "smoke" | "full" -> parameters, "num_programs" among them (at full size chosen so the
    # working sets are alike, 55-80k tokens, and one KV pool presses every program)
    sizes: dict[str, dict]
    fork_heavy: bool  # runs branches in parallel (the latency target applies)

    def inputs(self, words: Words, size: str, seed: int, start: int, count: int) -> list[dict]:
        """The inputs of programs start .. start+count-1 (index-seeded: any slice agrees)."""
        params = self.sizes[size]
        return [self.make_inputs(words, seed, params, i) for i in range(start, start + count)]
