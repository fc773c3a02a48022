"""The programs without the DSL: the code a user writes with the OpenAI client against the
same server. `sequential`: the sync client, a program's calls one after another (its
branches in a loop); `async`: the asyncio client, a program's branches gathered.

Prompts are text (the server tokenizes them); chat turns go to /v1/chat/completions; a
choice is scored as users do with the completions API: echo the prompt + choice with
max_tokens=0 and sum the choice's log-probs (the whole prompt's log-probs are computed, so
the cache serves none of it). Each request is recorded with the ids the server will see.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .accounting import Call, CallLog
from .base import ProgramSpec
from .text import BIAS

TIMEOUT_S = 3600.0


class OpenAIPlain:
    """PlainLLM over an OpenAI client (sync when `concurrent` is False, else async)."""

    def __init__(self, client: Any, model: str, tokenizer: Any, log: CallLog, concurrent: bool):
        self.client = client
        self.model = model
        self.tokenizer = tokenizer
        self.log = log
        self.concurrent = concurrent

    async def _call(self, create, **kw) -> Any:
        out = create(model=self.model, temperature=0, **kw)
        return await out if self.concurrent else out

    def _encode(self, text: str) -> tuple[int, ...]:
        bos = getattr(self.tokenizer, "bos_token", None)
        special = not (bos and text.startswith(bos))
        return tuple(self.tokenizer.encode(text, add_special_tokens=special))

    def _record(self, slot: int, kind: str, prompt: tuple, max_tokens: int, text: str = ""):
        output = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        limit = len(prompt) - 1 if kind == "gen" else 0
        self.log.put(slot, Call(kind, prompt, max_tokens, limit, output))

    async def gen(self, prompt: str, max_tokens: int, token: int) -> str:
        slot = self.log.reserve()
        out = await self._call(self.client.completions.create, prompt=prompt,
                               max_tokens=max_tokens, logit_bias={str(token): BIAS},
                               extra_body={"ignore_eos": True})  # fmt: skip
        text = out.choices[0].text
        self._record(slot, "gen", self._encode(prompt), max_tokens, text)
        return text

    async def chat(self, messages: list[dict], max_tokens: int, token: int) -> str:
        slot = self.log.reserve()
        out = await self._call(self.client.chat.completions.create, messages=messages,
                               max_tokens=max_tokens, logit_bias={str(token): BIAS},
                               extra_body={"ignore_eos": True})  # fmt: skip
        text = out.choices[0].message.content
        rendered = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        self._record(slot, "gen", self._encode(rendered), max_tokens, text)
        return text

    async def gen_json(self, prompt: str, schema: dict, max_tokens: int) -> str:
        slot = self.log.reserve()
        fmt = {"type": "json_schema", "json_schema": {"name": "fields", "schema": schema}}
        out = await self._call(
            self.client.completions.create,
            prompt=prompt,
            max_tokens=max_tokens,
            extra_body={"response_format": fmt},
        )
        text = out.choices[0].text
        self._record(slot, "gen", self._encode(prompt), max_tokens, text)
        return text

    async def select(self, prompt: str, choices: Sequence[str]) -> int:
        slot = self.log.reserve(len(choices))
        out = await self._call(self.client.completions.create,
                               prompt=[prompt + c for c in choices], max_tokens=0, echo=True,
                               logprobs=0)  # fmt: skip
        scores = []
        for choice in sorted(out.choices, key=lambda c: c.index):
            n = len(self.tokenizer.encode(choices[choice.index], add_special_tokens=False))
            scores.append(sum(choice.logprobs.token_logprobs[-n:]) / n)
        for k, c in enumerate(choices):
            self._record(slot + k, "score", self._encode(prompt + c), 0)
        return max(range(len(scores)), key=scores.__getitem__)

    async def all(self, branches: Sequence[Awaitable[Any]]) -> list[Any]:
        if self.concurrent:
            return list(await asyncio.gather(*branches))
        return [await b for b in branches]


class OpenAIRunner:
    """Runs programs with one OpenAI client, made once: `concurrent=False` the sync client,
    each program a plain loop in its own thread; True the async client on one event loop,
    a program's branches gathered. `threads` programs at a time either way."""

    def __init__(self, url: str, model: str, tokenizer: Any, concurrent: bool) -> None:
        import openai

        self.model, self.tokenizer, self.concurrent = model, tokenizer, concurrent
        kw = {"base_url": url + "/v1", "api_key": "none", "timeout": TIMEOUT_S, "max_retries": 0}
        if concurrent:
            self.loop = asyncio.new_event_loop()
            self.client = self.loop.run_until_complete(_make_async(openai.AsyncOpenAI, kw))
        else:
            self.client = openai.OpenAI(**kw)

    def run(self, spec: ProgramSpec, inputs: Sequence[dict], log: CallLog, threads: int):
        llm = OpenAIPlain(self.client, self.model, self.tokenizer, log, self.concurrent)
        if not self.concurrent:
            with ThreadPoolExecutor(threads) as pool:
                futures = [pool.submit(asyncio.run, spec.plain(llm, **kw)) for kw in inputs]
                for f in futures:
                    f.result()
            return
        gate = asyncio.Semaphore(threads)

        async def one(kw: dict) -> None:
            async with gate:
                await spec.plain(llm, **kw)

        async def main() -> None:
            await asyncio.gather(*(one(kw) for kw in inputs))

        self.loop.run_until_complete(main())

    def close(self) -> None:
        if self.concurrent:
            self.loop.run_until_complete(self.client.close())
            self.loop.close()
        else:
            self.client.close()


async def _make_async(cls, kw: dict) -> Any:
    return cls(**kw)
