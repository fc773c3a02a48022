"""The routes that make a replica a worker of sglang-router and vllm-router: server and
model metadata, load, cache flush, generation health, version, vLLM's tokenize /
detokenize, KV event sources, and GET /v1/models/{id}; and radixrt's retention-hold routes
(release holds early, the engine's cache pressure), which the DSL's `RuntimeEndpoint` uses.

Metadata fields are those the routers read (sglang-router's ServerInfo / model info,
vllm-router's model card); load is one entry per data-parallel rank (one here) with
sglang-router's `num_reqs`, `num_waiting_reqs`, `num_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

import msgspec
from aiohttp import web

from radixrt.sampling import SamplingParams
from radixrt.server.chat import chat_messages, check_chat_length, template_options
from radixrt.server.fields import decode_checked
from radixrt.server.http_util import FRONT, MODEL_NAME, UNKNOWN_FIELDS, json_response, read_body
from radixrt.server.kv_publisher import KVEventsConfig
from radixrt.server.kv_publisher import kv_event_sources as kv_event_sources_of
from radixrt.server.messages import SaltScope
from radixrt.server.protocol import ApiError, GenerationSpec, accepted_names
from radixrt.server.schemas import DetokenizeRequest, ReleaseHoldsBody, TokenizeRequest
from radixrt.server.tenants import request_is_admin, request_tenant, tenant_scope
from radixrt.server.tools.request import checked_tools, template_messages
from radixrt.server.validate import check_model, check_rid

HEALTH_GENERATE_TIMEOUT_S = 20.0  # /health_generate: one token within this long


def version() -> str:
    try:
        return metadata.version("radixrt")
    except metadata.PackageNotFoundError:
        return "0.0.0"


@dataclass(frozen=True)
class WorkerInfo:
    """What a replica says about itself (static for its life)."""

    model_path: str
    served_model_name: str
    tokenizer_path: str
    model_type: str | None = None
    architectures: list[str] | None = None
    tp_size: int = 1
    dp_size: int = 1  # one replica is one data-parallel rank
    version: str = field(default_factory=version)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # this process's id
    kv_events: KVEventsConfig | None = None  # where the scheduler publishes KV events

    @classmethod
    def of_model_dir(cls, model_path: str, served_model_name: str, tp_size: int = 1) -> WorkerInfo:
        """model_type and architectures from the dir's config.json (when readable)."""
        config: dict[str, Any] = {}
        try:
            with open(os.path.join(model_path, "config.json")) as f:
                config = json.load(f)
        except (OSError, ValueError):
            pass
        return cls(
            model_path=model_path,
            served_model_name=served_model_name,
            tokenizer_path=model_path,
            model_type=config.get("model_type"),
            architectures=config.get("architectures"),
            tp_size=tp_size,
        )


WORKER_INFO = web.AppKey("worker_info", WorkerInfo)


def add_worker_routes(app: web.Application, info: WorkerInfo) -> None:
    app[WORKER_INFO] = info
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/get_load", get_load)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_post("/release_cache_holds", release_cache_holds)
    app.router.add_get("/cache_pressure", cache_pressure)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/version", get_version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_get("/v1/models/{model_id:.+}", model_card)


def _limits(request: web.Request) -> dict[str, Any]:
    """Limits known once the scheduler is ready (None before)."""
    ready = request.app[FRONT].ready
    if ready is None:
        return {
            "max_total_tokens": None,
            "max_running_requests": None,
            "kv_block_size": None,
            "max_model_len": None,
        }
    return {
        "max_total_tokens": ready.kv_blocks_total * ready.block_size,
        "max_running_requests": ready.max_running_requests,
        "kv_block_size": ready.block_size,
        "max_model_len": ready.max_model_len,
    }


def _scheduling(request: web.Request) -> dict[str, Any]:
    """The scheduler's waiting-queue policy (SGLang's `schedule_policy`) and prefix cache
    mode (`prefix_cache`; SGLang's `disable_radix_cache`: none), None before it is ready.
    With both, a client tells whether the server holds back a request whose uncached prefix
    another request computes (radixrt.config.holds_back_shared_prefixes)."""
    ready = request.app[FRONT].ready
    if ready is None:
        return {"schedule_policy": None, "prefix_cache": None, "disable_radix_cache": None}
    return {
        "schedule_policy": ready.policy,
        "prefix_cache": ready.prefix_cache,
        "disable_radix_cache": ready.prefix_cache == "none",
    }


async def model_info(request: web.Request) -> web.Response:
    info = request.app[WORKER_INFO]
    return json_response(
        {
            "model_path": info.model_path,
            "served_model_name": info.served_model_name,
            "tokenizer_path": info.tokenizer_path,
            "is_generation": True,
            "model_type": info.model_type,
            "architectures": info.architectures,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
    )


async def server_info(request: web.Request) -> web.Response:
    info = request.app[WORKER_INFO]
    limits = _limits(request)
    return json_response(
        {
            **asdict(info),
            **limits,
            **_scheduling(request),
            "is_generation": True,
            "max_num_reqs": limits["max_running_requests"],
            "max_batch_size": limits["max_running_requests"],
            "page_size": limits["kv_block_size"],
            "load_balance_method": "round_robin",
            "disaggregation_mode": "null",
            "internal_states": [_load(request)],
            "frontend": "radixrt",
        }
    )


def _load(request: web.Request) -> dict[str, Any]:
    """This rank's load: requests running and waiting, KV tokens in use."""
    front = request.app[FRONT]
    snap, ready = front.outputs.snapshot, front.ready
    stats = snap.stats if snap else None
    running = stats.running if stats else 0
    waiting = stats.waiting if stats else 0
    block = ready.block_size if ready else 0
    used = (stats.kv_blocks_in_use if stats else 0) * block
    total = (ready.kv_blocks_total if ready else 0) * block
    return {
        "dp_rank": 0,
        "num_reqs": running + waiting,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_tokens": used,
        "num_used_tokens": used,
        "max_total_num_tokens": total,
        "token_usage": used / total if total else 0.0,
        "cache_hit_rate": stats.cache_hit_rate if stats else 0.0,
    }


async def get_load(request: web.Request) -> web.Response:
    return json_response([_load(request)])


def _caller_scope(request: web.Request) -> SaltScope | None:
    """The cache salts the caller acts on: its tenant's, or every salt (None) for an admin
    or on a server without tenants."""
    tenant = request_tenant(request)
    return None if tenant is None or request_is_admin(request) else tenant_scope(tenant)


async def flush_cache(request: web.Request) -> web.Response:
    """Empty the prefix cache: unlocked entries only (running requests keep theirs), the
    scheduler's integrity check after; with tenants, a tenant's flush empties only its own
    salts (and ends only its holds), an admin's everything. 500 when that check fails."""
    scope = _caller_scope(request)
    out = await request.app[FRONT].flush_cache(scope)
    if out.error is not None:
        raise ApiError(
            f"the cache flush left the KV pool inconsistent: {out.error.splitlines()[-1]}",
            status=500,
            type="server_error",
        )
    return json_response(
        {
            "success": True,
            "freed_blocks": out.freed_blocks,
            "scope": "all" if scope is None else "tenant",
        }
    )


async def release_cache_holds(request: web.Request) -> web.Response:
    """End early the retention holds (`cache_ttl_s`) of the caller's finished requests
    `rids` (/generate's `meta_info["id"]`; n > 1: every child's). Ids of requests another
    tenant made, unknown ids and requests that hold nothing count 0."""
    body: ReleaseHoldsBody = decode_checked(
        await read_body(request),
        ReleaseHoldsBody,
        "/release_cache_holds",
        request.app[UNKNOWN_FIELDS],
    )
    for rid in body.rids:
        check_rid(rid, "rids")
    released = await request.app[FRONT].release_cache_holds(request_tenant(request), body.rids)
    return json_response({"released": released})


async def cache_pressure(request: web.Request) -> web.Response:
    """The engine's retention holds against its KV pool (`radixrt.stats.CachePressure`);
    `held`: the ids of the caller's finished requests whose holds are in place. With tenants
    the figures are the caller's tenant's (an admin's: the whole engine's)."""
    front = request.app[FRONT]
    read = await front.cache_pressure(_caller_scope(request), request_tenant(request))
    out = msgspec.to_builtins(read.pressure)
    out["held"] = front.held.client_ids(request_tenant(request), read.pressure.held)
    return json_response(out)


async def health_generate(request: web.Request) -> web.Response:
    """200 once one token comes out of a 1-token generation; 503 otherwise."""
    front = request.app[FRONT]
    spec = GenerationSpec(prompts=[[0]], sampling=SamplingParams(temperature=0.0), max_tokens=1)
    try:
        async with front.generate(spec) as gen:
            await asyncio.wait_for(gen.wait(), HEALTH_GENERATE_TIMEOUT_S)
    except (ApiError, asyncio.TimeoutError) as e:
        message = e.message if isinstance(e, ApiError) else "no token in time"
        err = ApiError(f"generation is not healthy: {message}", status=503, type="server_error")
        return json_response(err.body(), status=503)
    return json_response({"status": "ok"})


async def get_version(request: web.Request) -> web.Response:
    return json_response({"version": request.app[WORKER_INFO].version})


async def kv_event_sources(request: web.Request) -> web.Response:
    """The KV event publishers of this replica ([] when events are off)."""
    ready = request.app[FRONT].ready
    block_size = ready.block_size if ready is not None else 0
    return json_response(kv_event_sources_of(request.app[WORKER_INFO].kv_events, block_size))


async def model_card(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    front = request.app[FRONT]
    name = request.app[MODEL_NAME]
    check_model(model_id, accepted_names(name))
    return json_response(
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "radixrt",
            "root": request.app[WORKER_INFO].model_path,
            "max_model_len": front.ready.max_model_len if front.ready else None,
        }
    )


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's POST /tokenize: `prompt` (special tokens added unless add_special_tokens is
    false) or chat `messages` rendered by the chat template."""
    front = request.app[FRONT]
    model = front.model_info()
    req: TokenizeRequest = decode_checked(
        await read_body(request), TokenizeRequest, "/tokenize", request.app[UNKNOWN_FIELDS]
    )
    check_model(req.model, model.accepted_names)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError("pass exactly one of prompt or messages", param="prompt")
    if req.prompt is not None:
        if len(req.prompt) > model.max_prompt_chars:
            raise ApiError(f"prompt has over {model.max_prompt_chars} characters", "prompt")
        text, special = req.prompt, req.add_special_tokens is not False
    else:
        if not req.messages:  # chat templates index the last message
            raise ApiError("messages is empty: at least one message is needed", "messages")
        check_chat_length(req.messages, req.tools, model)
        messages = chat_messages(req.messages)
        template_messages(messages, req.messages)
        options = template_options(
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            messages,
            checked_tools(req.tools)[1] if req.tools else None,
        )
        text = await front.off_loop(front.render_chat, messages, options)
        special = bool(req.add_special_tokens)
    ids = await front.off_loop(lambda: front.tokenizer.encode(text, add_special_tokens=special))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = front.tokenizer.convert_ids_to_tokens(ids)
    return json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's POST /detokenize: the text of `tokens` (special tokens kept)."""
    front = request.app[FRONT]
    model = front.model_info()
    req: DetokenizeRequest = decode_checked(
        await read_body(request), DetokenizeRequest, "/detokenize", request.app[UNKNOWN_FIELDS]
    )
    check_model(req.model, model.accepted_names)
    bad = [t for t in req.tokens if not 0 <= t < model.vocab_size]
    if bad:
        raise ApiError(
            f"token id {bad[0]} in tokens is outside the vocabulary [0, {model.vocab_size})",
            param="tokens",
        )
    return json_response({"prompt": front.tokenizer.decode(req.tokens)})
