"""Pieces shared by the route modules: app keys, request bodies, JSON responses, SSE
streaming."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from radixrt.server.fields import UnknownFields
from radixrt.server.front import Front
from radixrt.server.protocol import ApiError
from radixrt.server.request_state import Delta, Generation, RequestState

logger = logging.getLogger(__name__)

FRONT = web.AppKey("front", Front)
MODEL_NAME = web.AppKey("model_name", str)
UNKNOWN_FIELDS = web.AppKey("unknown_fields", UnknownFields)  # what to do with unknown names
# /generate streams: only what is new per event (True), or everything so far (SGLang's default)
INCREMENTAL_STREAMING = web.AppKey("incremental_streaming", bool)
# --tool-call-parser: a format name, or "auto" (the chat template's, tools.default_tool_parser)
TOOL_PARSER = web.AppKey("tool_parser", str)

_json = msgspec.json.Encoder()

MAX_BODY_BYTES = 64 * 1024 * 1024  # a request body at most (after decompression too)
# Content-Encoding -> zlib wbits (the server decodes bodies itself: aiohttp's decoder
# turns a bad body into an unhandled exception)
_ENCODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


async def read_body(request: web.Request) -> bytes:
    """The request's JSON body bytes: the Content-Type must be JSON (or absent), a
    Content-Encoding gzip or deflate is decoded. ApiError (400) otherwise."""
    ctype = request.headers.get("Content-Type")
    if ctype is not None:
        mime, _, params = ctype.partition(";")
        mime = mime.strip().lower()
        charset = params.strip().lower().removeprefix("charset=").strip('"') if params else ""
        if not (mime == "application/json" or mime.endswith("+json")) or charset not in (
            "",
            "utf-8",
        ):
            raise ApiError(
                f"unsupported Content-Type {ctype[:80]!r}: send 'application/json' (UTF-8)"
            )
    raw = await request.read()
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in _ENCODINGS:
        raise ApiError(f"unsupported Content-Encoding {encoding[:40]!r}: use gzip, deflate or none")
    inflater = zlib.decompressobj(_ENCODINGS[encoding])
    try:
        body = inflater.decompress(raw, MAX_BODY_BYTES + 1)
    except zlib.error as e:
        raise ApiError(f"the body is not valid {encoding} data ({e})") from None
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(f"the decoded body is over {MAX_BODY_BYTES} bytes", status=413)
    if not inflater.eof:
        raise ApiError(f"the body is truncated {encoding} data")
    return body


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


async def sse_response(
    request: web.Request,
    gen: Generation,
    chunks: Callable[[RequestState, Delta], list[dict]],
    opening: Callable[[], list[dict]] = list,
    closing: Callable[[], list[dict]] = list,
) -> web.StreamResponse:
    """Stream `chunks(state, delta)` per delta as SSE, then `closing()` and [DONE]: one
    write per batch of the generation (per scheduler step, or fewer when behind), never one
    per token. The first batch is awaited before the headers go out, so a request refused
    by the scheduler still gets its HTTP 400; a failure later ends the stream with an error
    event."""
    batches = gen.batches()
    first = await anext(batches, [])  # ApiError -> plain error response
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )

    def events(batch: list[tuple[RequestState, Delta]]) -> bytes:
        return b"".join(sse_event(c) for st, d in batch for c in chunks(st, d))

    try:
        await resp.prepare(request)
        await resp.write(b"".join(map(sse_event, opening())) + events(first))
        try:
            async for batch in batches:
                await resp.write(events(batch))
            tail = b"".join(map(sse_event, closing()))
        except ApiError as e:
            tail = sse_event(e.body())
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:  # the client left; `async with gen` aborts what is left
        logger.info("client disconnected mid-stream: %s", request.path)
    return resp


def sse_event(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def tool_parser(request: web.Request) -> str:
    """The tool-call format of the served model (--tool-call-parser, "auto": from the
    chat template)."""
    name = request.app.get(TOOL_PARSER, "auto")
    if name != "auto":
        return name
    from radixrt.server.tools import default_tool_parser

    return default_tool_parser(getattr(request.app[FRONT].tokenizer, "chat_template", None))
