"""The aiohttp app: routes, API-key and error middleware, health, metrics, /debug/state,
and the native /generate and /abort (OpenAI routes: `openai_routes`). Handlers parse with
`protocol`, run through the `Front`, and shape responses; every error is an OpenAI-shaped
JSON body."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from radixrt.server.connections import ConnectionLimits, body_deadline_middleware
from radixrt.server.fields import UnknownFields, decode_checked
from radixrt.server.front import Front
from radixrt.server.http_util import (
    FRONT,
    INCREMENTAL_STREAMING,
    MAX_BODY_BYTES,
    MODEL_NAME,
    TOOL_PARSER,
    UNKNOWN_FIELDS,
    json_response,
    read_body,
    sse_response,
)
from radixrt.server.lora_routes import add_lora_routes
from radixrt.server.messages import SchedulerSnapshot
from radixrt.server.metrics import CONTENT_TYPE
from radixrt.server.openai_routes import chat_completions, completions, models
from radixrt.server.protocol import ApiError
from radixrt.server.request_state import Delta, RequestState
from radixrt.server.schemas import AbortBody
from radixrt.server.tenants import (
    ADMIN,
    TENANT,
    Tenants,
    apply_tenant,
    authenticate,
    request_tenant,
)
from radixrt.server.validate import check_rid, parse_generate
from radixrt.server.worker_routes import WorkerInfo, add_worker_routes

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # answer without an API key
OPEN_WITHOUT_TENANTS = ("/metrics",)  # with tenants, these need the admin role
ADMIN_PATHS = ("/metrics", "/kv_event_sources")  # with tenants: the admin role only
DEBUG_PREFIX = "/debug/"  # with tenants: the admin role only
RETRY_AFTER_S = 5  # a 503's Retry-After


def create_app(
    front: Front,
    model_name: str,
    api_key: str | None = None,
    debug: bool = False,
    body_timeout_s: float = ConnectionLimits.body_timeout_s,
    worker: WorkerInfo | None = None,
    strict_fields: bool = False,
    incremental_streaming: bool = False,
    tenants: Tenants | None = None,
    tool_call_parser: str = "auto",
) -> web.Application:
    """The app; serve it with `handler_cancellation=True` (a client that leaves cancels
    its handler, which aborts its requests) and `auto_decompress=False` (`read_body`
    decodes bodies itself). A request body must arrive within `body_timeout_s` (408).
    `worker`: what the routers' worker routes report (default: `model_name` as the model
    path); `strict_fields`: refuse names no schema declares; `incremental_streaming`:
    /generate streams only what is new per event; `tenants`: API keys mapped to tenants (the
    cache salt namespaces of `radixrt.server.tenants`; `api_key` is then the shared tenant's);
    `tool_call_parser`: the format of the model's tool calls (radixrt.server.tools; "auto":
    from the chat template)."""
    middlewares = [
        _error_middleware,
        _auth_middleware(api_key, tenants),
        body_deadline_middleware(body_timeout_s, front.metrics, MAX_BODY_BYTES),
    ]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[FRONT] = front
    app[MODEL_NAME] = model_name
    app[UNKNOWN_FIELDS] = UnknownFields(strict_fields)
    app[INCREMENTAL_STREAMING] = incremental_streaming
    app[TOOL_PARSER] = tool_call_parser
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort", abort)
    add_lora_routes(app)
    add_worker_routes(app, worker or WorkerInfo.of_model_dir(model_name, model_name))
    if debug:
        app.router.add_get("/debug/state", debug_state)
    return app


@web.middleware
async def _error_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Every error is an OpenAI-shaped JSON body; a rejected request logs one line, a
    server bug (anything else raised) logs its traceback and answers 500."""
    try:
        return await handler(request)
    except ApiError as e:
        err = e
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = ApiError(f"{e.reason}: {request.method} {request.path}", status=e.status)
    except Exception as e:
        logger.exception("internal error on %s %s", request.method, request.path)
        request.app[FRONT].metrics.internal_errors.inc()
        err = ApiError(f"internal error: {type(e).__name__}", status=500, type="server_error")
        return json_response(err.body(), status=500)
    request.app[FRONT].metrics.rejected.labels(status=str(err.status)).inc()
    logger.info(
        "rejected %s %s: %d %s (param %s)",
        request.method, request.path, err.status, err.message[:200], err.param,
    )  # fmt: skip
    response = json_response(err.body(), status=err.status)
    if err.status == 503:  # the server's state, not the request: a router retries elsewhere
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def _auth_middleware(api_key: str | None, tenants: Tenants | None) -> Callable:
    """401 without a right key; with tenants, 403 for a tenant's key on an admin route
    (decided by the matched route, so no spelling of a path gets around it)."""
    api_key = api_key or None

    @web.middleware
    async def auth(request: web.Request, handler: Callable) -> web.StreamResponse:
        resource = request.match_info.route.resource
        path = request.path if resource is None else resource.canonical
        if path in OPEN_PATHS or (tenants is None and path in OPEN_WITHOUT_TENANTS):
            return await handler(request)
        caller = authenticate(request.headers.get("Authorization", ""), api_key, tenants)
        if caller is None:
            err = ApiError(
                "missing or wrong API key: send 'Authorization: Bearer <key>'", status=401
            )
            return json_response(err.body(), status=401)
        admin_only = path in ADMIN_PATHS or path.startswith(DEBUG_PREFIX)
        if tenants is not None and admin_only and not caller.admin:
            err = ApiError(f"{path} needs a key with the admin role", status=403)
            return json_response(err.body(), status=403)
        request[TENANT] = caller.tenant
        request[ADMIN] = caller.admin
        return await handler(request)

    return auth


# ---- plain routes ----
async def health(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    snap = front.outputs.snapshot
    if front.serving and snap is not None and snap.stats.grammar_compiler_failed:
        # the replica serves what needs no grammar; a balancer should prefer another
        detail = "the grammar compiler failed: structured output and tool calls get 503"
        return json_response({"status": "grammar_unavailable", "detail": detail}, status=503)
    if front.serving:
        return json_response({"status": "ok"})
    if front.dead:
        status, detail = "scheduler_dead", front.dead
    elif front.liveness.stalled:
        status, detail = "scheduler_stalled", front.stall_reason()
    else:
        status, detail = "loading", None
    return json_response({"status": status, "detail": detail}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[FRONT].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def debug_state(request: web.Request) -> web.Response:
    """The front's and the scheduler's state. `scheduler` is the latest snapshot (from
    Ready on); once the scheduler is gone it is the last one seen and `dead` says why."""
    front = request.app[FRONT]
    outputs = front.outputs
    snap = outputs.snapshot
    return json_response(
        {
            "serving": front.serving,
            "dead": front.dead,
            "scheduler_pid": front.ready.pid if front.ready else None,
            "in_flight": len(outputs.states),
            "in_flight_client_rids": len(outputs.by_client_rid),
            "scheduler": _snapshot_json(snap) if snap else None,
        }
    )


def _snapshot_json(snap: SchedulerSnapshot) -> dict[str, Any]:
    """The snapshot as one flat object: the EngineStats fields and `integrity_error`."""
    return {**msgspec.to_builtins(snap.stats), "integrity_error": snap.integrity_error}


async def abort(request: web.Request) -> web.Response:
    body: AbortBody = decode_checked(
        await read_body(request), AbortBody, "/abort", request.app[UNKNOWN_FIELDS]
    )
    check_rid(body.rid)
    n = request.app[FRONT].abort_client_rid(body.rid, request_tenant(request))
    return json_response({"rid": body.rid, "aborted": n})


# ---- native /generate ----
async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang's /generate: one output object per prompt and choice (a list when the prompt
    was a list or n > 1), `meta_info` with SGLang's fields, log-prob entries
    [logprob, token_id, text or null]. A stream's events carry the text, output ids and
    log-probs so far (SGLang's default), or only what is new with
    --incremental-streaming-output."""
    front = request.app[FRONT]
    model = front.model_info()  # 503 while not serving
    g = parse_generate(await read_body(request), model, request.app[UNKNOWN_FIELDS])
    spec = g.gen
    prompt_ids = await front.off_loop(front.encode, spec)
    tenant = request_tenant(request)
    spec = apply_tenant(spec, tenant)
    top = spec.sampling.top_logprobs
    text_of = (
        (lambda t: front.tokenizer.decode([t], skip_special_tokens=False))
        if g.return_text_in_logprobs
        else (lambda t: None)
    )

    def entries(lps: list, ids: list[int]) -> list[list]:
        return [[lp, t, text_of(t)] for lp, t in zip(lps, ids)]

    def meta(st: RequestState, d: Delta | None) -> dict[str, Any]:
        """meta_info: of the whole output (d None), or of delta `d` only."""
        reason = st.finish_reason if d is None else d.finish_reason
        m: dict[str, Any] = {
            "id": st.client_id,
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": st.completion_tokens,
            "cached_tokens": st.num_cached_tokens,
            "spec_draft_tokens": st.num_draft_tokens,  # speculative decoding, so far
            "spec_accepted_tokens": st.num_accepted_tokens,
            "finish_reason": None if reason is None else {"type": reason},
            "e2e_latency": time.perf_counter() - st.created,
        }
        if g.return_logprob:
            ids, lps = (st.output_ids, st.logprobs) if d is None else (d.token_ids, d.logprobs)
            m["output_token_logprobs"] = entries(lps, ids)
            if top:
                tops = st.top_logprobs if d is None else d.top_logprobs
                m["output_top_logprobs"] = [[[lp, t, text_of(t)] for t, lp in k] for k in tops]
        if g.logprob_start_len is not None and reason is not None:  # they come at the end
            start = max(1, g.logprob_start_len)
            lead = [[None, st.prompt_ids[0], text_of(st.prompt_ids[0])]]
            m["input_token_logprobs"] = (lead if g.logprob_start_len == 0 else []) + entries(
                st.prompt_logprobs, st.prompt_ids[start:]
            )
        elif g.return_logprob:
            m["input_token_logprobs"] = []
        return m

    many = spec.batched or spec.n > 1  # a list of outputs; streamed events carry "index"
    async with front.generate(spec, g.rid, tenant, prompt_ids) as gen:
        if spec.stream:
            incremental = request.app[INCREMENTAL_STREAMING]

            def chunks(st: RequestState, d: Delta) -> list[dict]:
                if incremental:
                    event = {"text": d.text, "output_ids": d.token_ids, "meta_info": meta(st, d)}
                else:  # everything so far (SGLang's default streaming)
                    info = meta(st, None)
                    info["finish_reason"] = (
                        None if d.finish_reason is None else {"type": d.finish_reason}
                    )
                    event = {"text": st.text, "output_ids": list(st.output_ids), "meta_info": info}
                if many:
                    event["index"] = st.index
                return [event]

            return await sse_response(request, gen, chunks)
        states = await gen.wait()
    if spec.beam_width is not None:  # W outputs per prompt, best first
        return json_response(
            [_beam_output(st, k, meta(st, None)) for st in states for k in range(len(st.beams))]
        )
    outs = [
        {"text": st.text, "output_ids": st.output_ids, "meta_info": meta(st, None)} for st in states
    ]
    return json_response(outs if many else outs[0])


def _beam_output(st: RequestState, k: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Sequence k (0: the best) of a finished beam search, as a /generate output."""
    b = st.beams[k]
    info = {
        **meta,
        "completion_tokens": len(b.output_ids),
        "finish_reason": {"type": b.finish_reason},
        "cumulative_logprob": b.cumulative_logprob,
        "score": b.score,
        "index": k,  # rank among the prompt's sequences
        "prompt_index": st.index,
    }
    return {"text": b.text, "output_ids": b.output_ids, "meta_info": info}
