"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from radixrt.server.front import Front
from radixrt.server.http_util import (
    FRONT,
    MODEL_NAME,
    UNKNOWN_FIELDS,
    json_response,
    read_body,
    sse_response,
    tool_parser,
)
from radixrt.server.lora_routes import adapter_cards
from radixrt.server.protocol import GenerationSpec
from radixrt.server.request_state import Delta, Generation, RequestState
from radixrt.server.tenants import apply_tenant, request_tenant
from radixrt.server.tools.output import ChatDeltas, chat_message
from radixrt.server.validate import parse_chat, parse_completion


async def models(request: web.Request) -> web.Response:
    """The served model (requests may also name it by its last path part or "default"), then
    its LoRA adapters (`model` may name one)."""
    front = request.app[FRONT]
    card = {
        "id": request.app[MODEL_NAME],
        "object": "model",
        "created": 0,
        "owned_by": "radixrt",
        "max_model_len": front.ready.max_model_len if front.ready else None,
    }
    return json_response({"object": "list", "data": [card, *adapter_cards(request)]})


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


Tops = list[list[tuple[int, float]]]  # per token: [(token id, log-prob)], most likely first


def _completion_logprobs(
    front: Front,
    ids: list[int],
    lps: list[float | None],
    tops: list[dict[str, float] | None] | None,
    offset: int,
) -> dict:
    """OpenAI's completion `logprobs`: tokens, token_logprobs, top_logprobs (None when
    `logprobs` was 0), text_offset (characters into the choice's text)."""
    tokens = _token_texts(front, ids)
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _padded(tops: Tops, n: int) -> Tops:
    """One list per token: what the scheduler sent, [] for tokens it sent none for."""
    return [*tops[:n], *([] for _ in range(n - len(tops)))]


def _top_dicts(front: Front, tops: Tops, n: int, want: int) -> list[dict[str, float]] | None:
    """Per token {token text: log-prob} of the alternatives the scheduler sent ({} for a
    token it sent none for); None when no alternatives were asked."""
    if not want:
        return None
    decode = lambda t: front.tokenizer.decode([t], skip_special_tokens=False)
    return [{decode(t): lp for t, lp in top} for top in _padded(tops, n)]


def _choice_logprobs(front: Front, st: RequestState, ids, lps, tops, offset: int) -> dict:
    want = st.params.top_logprobs
    return _completion_logprobs(front, ids, lps, _top_dicts(front, tops, len(ids), want), offset)


def _echo_logprobs(front: Front, st: RequestState) -> dict:
    """Prompt then output: the first prompt token has no log-prob (None, as OpenAI)."""
    want = st.params.top_logprobs
    prompt_lps: list[float | None] = [None, *st.prompt_logprobs]
    ids = st.prompt_ids + st.output_ids
    tops = None
    if want:
        out_tops = _top_dicts(front, st.top_logprobs, len(st.output_ids), want) or []
        tops = [None, *({} for _ in st.prompt_logprobs), *out_tops]
    return _completion_logprobs(front, ids, prompt_lps + st.logprobs, tops, 0)


def _chat_logprobs(front: Front, ids: list[int], lps: list[float], tops: Tops) -> dict:
    def entry(token_id: int, lp: float) -> dict:
        tok = front.tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

    tops = _padded(tops, len(ids))
    content = [
        {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]}
        for t, lp, top in zip(ids, lps, tops)
    ]
    return {"content": content}


def _prompt_text(front: Front, spec: GenerationSpec, st: RequestState) -> str:
    """The prompt of a choice as text (echo): the request's string, or its ids decoded."""
    prompt = spec.prompts[st.index // spec.n]
    if isinstance(prompt, str):
        return prompt
    return front.tokenizer.decode(prompt, skip_special_tokens=False)


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
    spec = parse_completion(
        await read_body(request), front.model_info(), request.app[UNKNOWN_FIELDS]
    )
    prompt_ids = await front.off_loop(front.encode, spec)
    tenant = request_tenant(request)
    spec = apply_tenant(spec, tenant)
    head = _Ids(request, "cmpl", "text_completion").head
    want_lp = spec.sampling.logprobs
    # known by the response's id: POST /abort and /release_cache_holds take it
    async with front.generate(spec, head["id"], tenant, prompt_ids) as gen:
        if spec.stream:
            offsets = [0] * len(gen.states)

            def opening() -> list[dict]:  # echo: the prompt first (stream: no log-probs)
                if not spec.echo:
                    return []
                out = []
                for st in gen.states:
                    text = _prompt_text(front, spec, st)
                    offsets[st.index] = len(text)
                    choice = {"index": st.index, "text": text, "logprobs": None}
                    out.append(_chunk(head, [{**choice, "finish_reason": None}], spec, gen))
                return out

            def chunks(st: RequestState, d: Delta) -> list[dict]:
                lp = None
                if want_lp:
                    lps = d.logprobs
                    lp = _choice_logprobs(
                        front, st, d.token_ids, lps, d.top_logprobs, offsets[st.index]
                    )
                offsets[st.index] += len(d.text)
                choice = {
                    "index": st.index,
                    "text": d.text,
                    "logprobs": lp,
                    "finish_reason": d.finish_reason,
                }
                return [_chunk(head, [choice], spec, gen)]

            closing = _usage_chunk(head, gen, spec)
            return await sse_response(request, gen, chunks, opening, closing)
        states = await gen.wait()
    choices = []
    for st in states:
        text, lp = st.text, None
        if spec.echo:
            prompt_text = _prompt_text(front, spec, st)
            text = prompt_text + st.text
            if want_lp:
                lp = _echo_logprobs(front, st)
        elif want_lp:
            lp = _choice_logprobs(front, st, st.output_ids, st.logprobs, st.top_logprobs, 0)
        choice = {"index": st.index, "text": text, "logprobs": lp}
        choices.append({**choice, "finish_reason": st.finish_reason})
    return json_response({**head, "choices": choices, "usage": _usage(states, spec.n)})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    body, model = await read_body(request), front.model_info()
    parse = (body, model, front.render_chat, request.app[UNKNOWN_FIELDS], tool_parser(request))
    spec = await front.off_loop(parse_chat, *parse)  # renders the chat template
    prompt_ids = await front.off_loop(front.encode, spec)
    tenant = request_tenant(request)
    spec = apply_tenant(spec, tenant)
    head = _Ids(request, "chatcmpl", "chat.completion").head
    want_lp = spec.sampling.logprobs
    # known by the response's id: POST /abort and /release_cache_holds take it
    async with front.generate(spec, head["id"], tenant, prompt_ids) as gen:
        if spec.stream:
            chead = {**head, "object": "chat.completion.chunk"}
            deltas = ChatDeltas(spec.tools)

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
                        gen,
                    )
                    for st in gen.states
                ]

            def chunks(st: RequestState, d: Delta) -> list[dict]:
                delta, reason = deltas.delta(st.index, d.text, d.finish_reason)
                choice = {
                    "index": st.index,
                    "delta": delta,
                    "logprobs": (
                        _chat_logprobs(front, d.token_ids, d.logprobs, d.top_logprobs)
                        if want_lp
                        else None
                    ),
                    "finish_reason": reason,
                }
                return [_chunk(chead, [choice], spec, gen)]

            return await sse_response(request, gen, chunks, opening, _usage_chunk(chead, gen, spec))
        states = await gen.wait()
    choices = []
    for st in states:
        message, reason = chat_message(st.text, st.finish_reason, spec.tools)
        lps = (
            _chat_logprobs(front, st.output_ids, st.logprobs, st.top_logprobs) if want_lp else None
        )
        choices.append({"index": st.index, "message": message, "logprobs": lps,
                        "finish_reason": reason})  # fmt: skip
    return json_response({**head, "choices": choices, "usage": _usage(states, spec.n)})


def _chunk(head: dict, choices: list[dict], spec: GenerationSpec, gen: Generation) -> dict:
    """A stream chunk: usage null when only the last chunk has it, the usage so far with
    continuous_usage_stats."""
    chunk = {**head, "choices": choices}
    if spec.continuous_usage:
        chunk["usage"] = _usage(gen.states, spec.n)
    elif spec.include_usage:
        chunk["usage"] = None
    return chunk


def _usage_chunk(head: dict, gen: Generation, spec: GenerationSpec) -> Callable[[], list[dict]]:
    def closing() -> list[dict]:
        if not (spec.include_usage or spec.continuous_usage):
            return []
        return [{**head, "choices": [], "usage": _usage(gen.states, spec.n)}]

    return closing
