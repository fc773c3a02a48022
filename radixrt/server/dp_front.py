"""The public endpoint of `serve --dp N`: authenticates as a single server does, then hands
each request to sglang-router or to the replicas, all of which listen on loopback only.

sglang-router serves its worker management (`/workers`, `/add_worker`, `/get_loads`, ...) on
its client port without a key, so clients never reach the router itself:
- generation and model routes go to the router (a `/v1/completions` or chat request without
  `model` gets the served model's name, as a single server accepts it; a non-streamed
  `/generate` with a list `text` or `input_ids` goes as one request per prompt, which the
  router accepts, and the outputs come back as one list in order; a streamed one goes whole
  to one replica);
- the tenant-scoped control routes (`/abort`, `/flush_cache`, `/release_cache_holds`,
  `/cache_pressure`) and `/tokenize`, `/detokenize` go to every replica (or one) with the
  caller's key, and each replica scopes them to the caller's tenant; the answers are summed;
- `/metrics` (the router's Prometheus text) and `/kv_event_sources` (every replica's) need
  the admin role when tenants are configured, as on a single server;
- the router's management routes need an admin key: `--api-key` without tenants, or an
  `admin` entry of the keys file; without any key they answer 403 to everyone.
Anything else is 404 (`/debug/*` included: read a replica's own port).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from radixrt.server.http_util import MAX_BODY_BYTES, json_response, read_body
from radixrt.server.protocol import ApiError
from radixrt.server.tenants import Tenants, authenticate

logger = logging.getLogger("radixrt.dp")

# to the router, for any caller with a key (or anyone without keys)
ROUTER_ROUTES = (
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/generate"),
    ("GET", "/v1/models"), ("GET", "/get_model_info"), ("GET", "/get_server_info"),
    ("GET", "/health_generate"),
)  # fmt: skip
# to every replica with the caller's key; each scopes the call to the caller's tenant
FAN_OUT_ROUTES = (
    ("POST", "/abort"), ("GET", "/flush_cache"), ("POST", "/flush_cache"),
    ("POST", "/release_cache_holds"), ("GET", "/cache_pressure"),
)  # fmt: skip
ONE_REPLICA_ROUTES = (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models/{m}"))
# sglang-router's management routes: an admin key only
MANAGEMENT_ROUTES = (
    ("*", "/workers"), ("*", "/workers/{tail:.+}"), ("*", "/add_worker"),
    ("*", "/remove_worker"), ("*", "/list_workers"), ("GET", "/get_loads"),
)  # fmt: skip
OPEN_PATHS = ("/health",)
SAME_ON_EVERY_REPLICA = ("block_size",)  # fan-out answers: kept, not summed
FORWARDED_HEADERS = ("Authorization", "Accept")
UPSTREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10)


@dataclass(frozen=True)
class Upstreams:
    """Where the front sends requests (all on loopback)."""

    router_url: str
    replica_urls: tuple[str, ...]
    metrics_url: str  # the router's Prometheus endpoint
    model_name: str  # the served model's id (a request without `model` gets it)


UPSTREAMS = web.AppKey("upstreams", Upstreams)
SESSION = web.AppKey("session", aiohttp.ClientSession)


def create_front_app(
    upstreams: Upstreams, api_key: str | None, tenants: Tenants | None
) -> web.Application:
    """The front's app: authentication first, then the routes of the module docstring."""
    app = web.Application(
        middlewares=[_errors, _auth(api_key or None, tenants)], client_max_size=MAX_BODY_BYTES
    )
    app[UPSTREAMS] = upstreams
    app.cleanup_ctx.append(_session)
    app.router.add_get("/health", _to_router)
    for method, path in ROUTER_ROUTES:
        app.router.add_route(method, path, _generate if path == "/generate" else _to_router)
    for method, path in FAN_OUT_ROUTES:
        app.router.add_route(method, path, _fan_out)
    for method, path in ONE_REPLICA_ROUTES:
        app.router.add_route(method, path, _to_one_replica)
    for method, path in MANAGEMENT_ROUTES:
        app.router.add_route(method, path, _manage)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/kv_event_sources", _kv_event_sources)
    return app


async def _session(app: web.Application):
    async with aiohttp.ClientSession(timeout=UPSTREAM_TIMEOUT, auto_decompress=False) as s:
        app[SESSION] = s
        yield


@web.middleware
async def _errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = ApiError(f"{e.reason}: {request.method} {request.path}", status=e.status)
        return json_response(err.body(), status=e.status)
    except aiohttp.ClientError as e:
        logger.warning("upstream of %s %s failed: %r", request.method, request.path, e)
        err = ApiError("no replica answered; retry shortly", status=503, type="server_error")
        return json_response(err.body(), status=503)


def _auth(api_key: str | None, tenants: Tenants | None) -> Callable:
    """401 without a right key; 403 for a non-admin caller on an admin route (decided by
    the matched route, so no spelling of a path gets around it)."""
    keyed = api_key is not None or tenants is not None

    @web.middleware
    async def auth(request: web.Request, handler: Callable) -> web.StreamResponse:
        resource = request.match_info.route.resource
        if resource is None:  # no such route: 404 for everyone
            return await handler(request)
        path = resource.canonical
        if path in OPEN_PATHS or (tenants is None and path == "/metrics"):
            return await handler(request)
        caller = authenticate(request.headers.get("Authorization", ""), api_key, tenants)
        if caller is None:
            err = ApiError(
                "missing or wrong API key: send 'Authorization: Bearer <key>'", status=401
            )
            return json_response(err.body(), status=401)
        handler_of = request.match_info.handler
        if handler_of is _manage and not (keyed and caller.admin):
            why = "a key with the admin role" if keyed else "an admin key, and none is set"
            err = ApiError(f"{path} manages the router's workers: it needs {why}", status=403)
            return json_response(err.body(), status=403)
        observer = handler_of in (_metrics, _kv_event_sources)
        if tenants is not None and observer and not caller.admin:
            err = ApiError(f"{path} needs a key with the admin role", status=403)
            return json_response(err.body(), status=403)
        return await handler(request)

    return auth


def _headers(request: web.Request, json_body: bool) -> dict[str, str]:
    out = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
    if json_body:
        out["Content-Type"] = "application/json"
    return out


async def _body(request: web.Request) -> bytes | None:
    """The decoded JSON body of a request that has one (None for GET)."""
    return await read_body(request) if request.method != "GET" else None


async def _relay(
    request: web.Request, url: str, body: bytes | None, headers: dict[str, str]
) -> web.StreamResponse:
    """Send to `url` and stream its answer back as it comes (SSE included); the client
    leaving cancels this handler, which closes the upstream request."""
    session = request.app[SESSION]
    async with session.request(request.method, url, data=body, headers=headers) as up:
        ctype = up.headers.get("Content-Type", "application/json")
        if "text/event-stream" not in ctype:
            data = await up.read()
            return web.Response(body=data, status=up.status, headers={"Content-Type": ctype})
        resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype})
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def _to_router(request: web.Request) -> web.StreamResponse:
    ups = request.app[UPSTREAMS]
    body = await _body(request)
    if body is not None and request.path in ("/v1/completions", "/v1/chat/completions"):
        body = _with_model(body, ups.model_name)
    url = ups.router_url + request.rel_url.path_qs
    return await _relay(request, url, body, _headers(request, body is not None))


async def _manage(request: web.Request) -> web.StreamResponse:
    """The router's worker management (an admin caller only: `_auth`)."""
    return await _to_router(request)


def _with_model(body: bytes, model: str) -> bytes:
    """The body with `model` set when the client left it out (a single server defaults it)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body  # the replica says what is wrong with it
    if not isinstance(obj, dict) or obj.get("model") is not None:
        return body
    obj["model"] = model
    return json.dumps(obj).encode()


PER_PROMPT_FIELDS = ("text", "input_ids", "rid", "sampling_params")  # split with the batch


async def _generate(request: web.Request) -> web.StreamResponse:
    """/generate: a batch (list `text`, or `input_ids` as a list of lists) goes as one
    request per prompt (sglang-router refuses batches), or whole to one replica when
    streamed or when another field varies per prompt."""
    ups = request.app[UPSTREAMS]
    body = await read_body(request)
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    prompts = _batch_size(obj)
    if prompts is None:
        return await _relay(request, ups.router_url + "/generate", body, _headers(request, True))
    per_prompt = [k for k, v in obj.items() if isinstance(v, list) and k not in PER_PROMPT_FIELDS]
    if obj.get("stream") or per_prompt or prompts == 0:
        url = ups.replica_urls[next(_turn) % len(ups.replica_urls)] + "/generate"
        return await _relay(request, url, body, _headers(request, True))
    session, headers = request.app[SESSION], _headers(request, True)

    async def one(i: int) -> tuple[int, Any]:
        part = dict(obj)
        for k in PER_PROMPT_FIELDS:
            if isinstance(obj.get(k), list) and (k != "input_ids" or prompts_are_lists):
                part[k] = obj[k][i]
        url = ups.router_url + "/generate"
        async with session.post(url, data=json.dumps(part).encode(), headers=headers) as up:
            return up.status, await up.json(content_type=None)

    prompts_are_lists = isinstance(obj.get("input_ids"), list) and bool(obj["input_ids"])
    prompts_are_lists = prompts_are_lists and isinstance(obj["input_ids"][0], list)
    answers = await asyncio.gather(*(one(i) for i in range(prompts)))
    for status, out in answers:
        if status != 200:
            return json_response(out, status=status)
    outputs: list[Any] = []
    for _, out in answers:
        outputs.extend(out if isinstance(out, list) else [out])
    return json_response(outputs)


_turn = itertools.count()


def _batch_size(obj: Any) -> int | None:
    """The number of prompts of a batched /generate body, None when it is not a batch."""
    if not isinstance(obj, dict):
        return None
    text, ids = obj.get("text"), obj.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


async def _fan_out(request: web.Request) -> web.Response:
    """Every replica, with the caller's key; 200 answers are summed (numbers) or merged."""
    ups = request.app[UPSTREAMS]
    body = await _body(request)
    answers = await _each_replica(request, body)
    ok = [out for status, out in answers if status == 200]
    if not ok:
        status, out = answers[0]
        return json_response(out, status=status)
    return json_response(_merge(ok, request.path, len(ups.replica_urls) - len(ok)))


async def _each_replica(request: web.Request, body: bytes | None) -> list[tuple[int, Any]]:
    ups, session = request.app[UPSTREAMS], request.app[SESSION]
    headers = _headers(request, body is not None)

    async def one(url: str) -> tuple[int, Any]:
        try:
            async with session.request(
                request.method, url + request.rel_url.path_qs, data=body, headers=headers
            ) as up:
                return up.status, await up.json(content_type=None)
        except (aiohttp.ClientError, ValueError) as e:
            err = ApiError(f"replica {url} did not answer ({type(e).__name__})", status=503)
            return 503, err.body()

    return list(await asyncio.gather(*(one(u) for u in ups.replica_urls)))


def _merge(outs: list[dict], path: str, missing: int) -> dict[str, Any]:
    """One answer from the replicas' answers: numbers summed, lists joined, booleans
    and-ed, dicts (per-adapter counters, ...) merged the same way key by key;
    `replicas_unreachable` counts those that did not answer 200."""
    merged: dict[str, Any] = {}
    for out in outs:
        _merge_into(merged, out)
    merged["replicas_unreachable"] = missing
    return merged


def _merge_into(merged: dict[str, Any], out: dict[str, Any], top: bool = True) -> None:
    for k, v in out.items():
        if top and k in SAME_ON_EVERY_REPLICA:
            merged.setdefault(k, v)
        elif isinstance(v, bool):
            merged[k] = merged.get(k, True) and v
        elif isinstance(v, (int, float)):
            merged[k] = merged.get(k, 0) + v
        elif isinstance(v, list):
            merged[k] = sorted({*merged.get(k, []), *v}, key=str)
        elif isinstance(v, dict) and isinstance(merged.get(k, {}), dict):
            _merge_into(merged.setdefault(k, {}), v, top=False)
        else:
            merged.setdefault(k, v)


async def _to_one_replica(request: web.Request) -> web.StreamResponse:
    ups = request.app[UPSTREAMS]
    body = await _body(request)
    url = ups.replica_urls[next(_turn) % len(ups.replica_urls)] + request.rel_url.path_qs
    return await _relay(request, url, body, _headers(request, body is not None))


async def _metrics(request: web.Request) -> web.StreamResponse:
    return await _relay(request, request.app[UPSTREAMS].metrics_url, None, {})


async def _kv_event_sources(request: web.Request) -> web.Response:
    answers = await _each_replica(request, None)
    return json_response([s for status, out in answers if status == 200 for s in out])


class FrontThread:
    """The front's app served on host:port by an event loop in a thread of its own."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.app, self.host, self.port = app, host, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dp-front", daemon=True)
        self._runner = web.AppRunner(app, handler_cancellation=True)

    def start(self) -> None:
        """Listen on host:port (raises OSError when it cannot)."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()

    async def _start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
