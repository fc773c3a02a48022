"""The aiohttp app: OpenAI-compatible routes, the native /generate and /abort, health,
metrics and (for tests) /debug/state. Handlers parse with `protocol`, run through the
`Front`, and shape responses; every error is an OpenAI-shaped JSON body."""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from radixrt.server.front import Delta, Front, Generation, RequestState
from radixrt.server.metrics import CONTENT_TYPE
from radixrt.server.protocol import (
    AbortBody,
    ApiError,
    GenerationSpec,
    decode,
    parse_chat,
    parse_completion,
    parse_generate,
)

logger = logging.getLogger(__name__)

FRONT = web.AppKey("front", Front)
MODEL_NAME = web.AppKey("model_name", str)
OPEN_PATHS = ("/health", "/metrics")  # answer without an API key
MAX_BODY_BYTES = 64 * 1024 * 1024

_json = msgspec.json.Encoder()


def create_app(
    front: Front, model_name: str, api_key: str | None = None, debug: bool = False
) -> web.Application:
    app = web.Application(
        middlewares=[_error_middleware, _auth_middleware(api_key)], client_max_size=MAX_BODY_BYTES
    )
    app[FRONT] = front
    app[MODEL_NAME] = model_name
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort", abort)
    if debug:
        app.router.add_get("/debug/state", debug_state)
    return app


def _response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


@web.middleware
async def _error_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return _response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = ApiError(f"{e.reason}: {request.method} {request.path}", status=e.status)
        return _response(err.body(), status=e.status)


def _auth_middleware(api_key: str | None) -> Callable:
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def auth(request: web.Request, handler: Callable) -> web.StreamResponse:
        if expected is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                err = ApiError(
                    "missing or wrong API key: send 'Authorization: Bearer <key>'", status=401
                )
                return _response(err.body(), status=401)
        return await handler(request)

    return auth


# ---- plain routes ----
async def health(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    if front.serving:
        return _response({"status": "ok"})
    status = "scheduler_dead" if front.dead else "loading"
    return _response({"status": status, "detail": front.dead}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[FRONT].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def models(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    card = {
        "id": request.app[MODEL_NAME],
        "object": "model",
        "created": 0,
        "owned_by": "radixrt",
        "max_model_len": front.ready.max_model_len if front.ready else None,
    }
    return _response({"object": "list", "data": [card]})


async def debug_state(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    snap = front.snapshot
    return _response(
        {
            "serving": front.serving,
            "dead": front.dead,
            "scheduler_pid": front.ready.pid if front.ready else None,
            "in_flight": len(front.states),
            "scheduler": msgspec.structs.asdict(snap) if snap else None,
        }
    )


async def abort(request: web.Request) -> web.Response:
    body: AbortBody = decode(await request.read(), AbortBody)
    n = request.app[FRONT].abort_group(body.rid)
    return _response({"rid": body.rid, "aborted": n})


# ---- streaming helper ----
async def _sse(
    request: web.Request,
    gen: Generation,
    chunks: Callable[[RequestState, Delta], list[dict]],
    opening: Callable[[], list[dict]] = list,
    closing: Callable[[], list[dict]] = list,
) -> web.StreamResponse:
    """Stream `chunks(state, delta)` per event as SSE, then `closing()` and [DONE].
    The first event is awaited before the headers go out, so a request refused by the
    scheduler still gets its HTTP 400; a failure later ends the stream with an error event."""
    events = gen.stream()
    first = await anext(events)  # ApiError -> plain error response
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)

    async def all_events() -> AsyncIterator[tuple[RequestState, Delta]]:
        yield first
        async for ev in events:
            yield ev

    try:
        for chunk in opening():
            await _write_event(resp, chunk)
        try:
            async for st, delta in all_events():
                for chunk in chunks(st, delta):
                    await _write_event(resp, chunk)
            for chunk in closing():
                await _write_event(resp, chunk)
        except ApiError as e:
            await _write_event(resp, e.body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:  # the client left; `async with gen` aborts what is left
        logger.info("client disconnected mid-stream: %s", request.path)
    return resp


async def _write_event(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + _json.encode(obj) + b"\n\n")


# ---- OpenAI routes ----
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

            return await _sse(request, gen, chunks, closing=_usage_chunk(head, gen, spec))
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
    return _response({**head, "choices": choices, "usage": _usage(states, spec.n)})


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

            return await _sse(request, gen, chunks, opening, _usage_chunk(chead, gen, spec))
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
    return _response({**head, "choices": choices, "usage": _usage(states, spec.n)})


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


# ---- native /generate ----
async def generate(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    g = parse_generate(await request.read())
    spec = g.gen
    params = spec.sampling

    def meta(st: RequestState, d: Delta | None) -> dict[str, Any]:
        reason = st.finish_reason if d is None else d.finish_reason
        m: dict[str, Any] = {
            "id": st.rid,
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": st.completion_tokens,
            "cached_tokens": st.num_cached_tokens,
            "finish_reason": None if reason is None else {"type": reason},
            "e2e_latency": time.perf_counter() - st.created,
        }
        if params["logprobs"]:
            m["output_token_logprobs"] = st.logprobs if d is None else d.logprobs
        if params["prompt_logprobs"] and reason is not None:
            lead = [None] if g.logprob_start_len == 0 else []
            m["input_token_logprobs"] = lead + st.prompt_logprobs
        return m

    async with front.generate(spec, group=g.rid) as gen:
        if spec.stream:

            def chunks(st: RequestState, d: Delta) -> list[dict]:
                event = {"text": d.text, "output_ids": d.token_ids, "meta_info": meta(st, d)}
                if spec.batched:
                    event["index"] = st.index
                return [event]

            return await _sse(request, gen, chunks)
        states = await gen.wait()
    outs = [
        {"text": st.text, "output_ids": st.output_ids, "meta_info": meta(st, None)} for st in states
    ]
    return _response(outs if spec.batched else outs[0])
