"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from radixrt.server.front import Front
from radixrt.server.http_util import FRONT, MODEL_NAME, json_response, sse_response
from radixrt.server.protocol import GenerationSpec, parse_chat, parse_completion
from radixrt.server.request_state import Delta, Generation, RequestState


async def models(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    card = {
        "id": request.app[MODEL_NAME],
        "object": "model",
        "created": 0,
        "owned_by": "radixrt",
        "max_model_len": front.ready.max_model_len if front.ready else None,
    }
    return json_response({"object": "list", "data": [card]})


def _usage(states: list[RequestState], n: int) -> dict[str, Any]:
    """Prompt (and cached) tokens count once per prompt, however many choices it has."""
    prompt = cached = 0
    for i in range(0, len(states), n):
        group = states[i : i + n]
        prompt += group[0].prompt_tokens
        cached += max(st.num_cached_tokens for st in group)
    completion = sum(st.completion_tokens for st in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_texts(front: Front, ids: list[int]) -> list[str]:
    return [front.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def _completion_logprobs(front: Front, ids: list[int], lps: list[float], offset: int) -> dict:
    tokens = _token_texts(front, ids)
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}


def _chat_logprobs(front: Front, ids: list[int], lps: list[float]) -> dict:
    content = [
        {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
        for tok, lp in zip(_token_texts(front, ids), lps)
    ]
    return {"content": content}


class _Ids:
    """id / created / model shared by every chunk of one response."""

    def __init__(self, request: web.Request, prefix: str, obj: str) -> None:
        self.head = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": obj,
            "created": int(time.time()),
            "model": request.app[MODEL_NAME],
        }


async def completions(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    spec = parse_completion(await request.read())
    head = _Ids(request, "cmpl", "text_completion").head
    want_lp = spec.sampling["logprobs"]
    async with front.generate(spec) as gen:
        if spec.stream:
            offsets = [0] * len(gen.states)

            def chunks(st: RequestState, d: Delta) -> list[dict]:
                lp = None
                if want_lp:
                    lp = _completion_logprobs(front, d.token_ids, d.logprobs, offsets[st.index])
                offsets[st.index] += len(d.text)
                choice = {
                    "index": st.index,
                    "text": d.text,
                    "logprobs": lp,
                    "finish_reason": d.finish_reason,
                }
                return [_chunk(head, [choice], spec)]

            return await sse_response(request, gen, chunks, closing=_usage_chunk(head, gen, spec))
        states = await gen.wait()
    choices = [
        {
            "index": st.index,
            "text": st.text,
            "logprobs": (
                _completion_logprobs(front, st.output_ids, st.logprobs, 0) if want_lp else None
            ),
            "finish_reason": st.finish_reason,
        }
        for st in states
    ]
    return json_response({**head, "choices": choices, "usage": _usage(states, spec.n)})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    spec = parse_chat(await request.read(), front.render_chat)
    head = _Ids(request, "chatcmpl", "chat.completion").head
    want_lp = spec.sampling["logprobs"]
    async with front.generate(spec) as gen:
        if spec.stream:
            chead = {**head, "object": "chat.completion.chunk"}

            def opening() -> list[dict]:
                return [
                    _chunk(
                        chead,
                        [
                            {
                                "index": st.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        spec,
                    )
                    for st in gen.states
                ]

            def chunks(st: RequestState, d: Delta) -> list[dict]:
                choice = {
                    "index": st.index,
                    "delta": {"content": d.text} if d.text else {},
                    "logprobs": _chat_logprobs(front, d.token_ids, d.logprobs) if want_lp else None,
                    "finish_reason": d.finish_reason,
                }
                return [_chunk(chead, [choice], spec)]

            return await sse_response(request, gen, chunks, opening, _usage_chunk(chead, gen, spec))
        states = await gen.wait()
    choices = [
        {
            "index": st.index,
            "message": {"role": "assistant", "content": st.text},
            "logprobs": _chat_logprobs(front, st.output_ids, st.logprobs) if want_lp else None,
            "finish_reason": st.finish_reason,
        }
        for st in states
    ]
    return json_response({**head, "choices": choices, "usage": _usage(states, spec.n)})


def _chunk(head: dict, choices: list[dict], spec: GenerationSpec) -> dict:
    chunk = {**head, "choices": choices}
    if spec.include_usage:
        chunk["usage"] = None
    return chunk


def _usage_chunk(head: dict, gen: Generation, spec: GenerationSpec) -> Callable[[], list[dict]]:
    def closing() -> list[dict]:
        if not spec.include_usage:
            return []
        return [{**head, "choices": [], "usage": _usage(gen.states, spec.n)}]

    return closing
