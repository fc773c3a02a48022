"""LoRA adapter routes: vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, SGLang's
`/load_lora_adapter` and `/unload_lora_adapter`, and the adapters' cards in /v1/models.

The front's `LoraRegistry` is the one list of adapters: a request names one (OpenAI `model`,
SGLang `lora_path`) and carries its `LoraRef` to the scheduler, whose runner reads the
weights from the adapter's directory when it first needs them. With tenants, loading and
unloading need the admin role (a load reads a directory of the server's choosing)."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from radixrt.lora import LoraLoadError, UnknownLora
from radixrt.server.http_util import FRONT, MODEL_NAME, json_response, read_body
from radixrt.server.protocol import ApiError
from radixrt.server.tenants import request_is_admin, request_tenant


class LoadBody(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str


class UnloadBody(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name decides


def adapter_cards(request: web.Request) -> list[dict[str, Any]]:
    """/v1/models entries of the loaded adapters (vLLM's shape: `parent` is the base)."""
    loras = request.app[FRONT].loras
    if loras is None:
        return []
    parent = request.app[MODEL_NAME]
    return [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "radixrt",
            "root": loras.resolve(name).path,
            "parent": parent,
        }
        for name in loras.names()
    ]


def _registry(request: web.Request):
    if request_tenant(request) is not None and not request_is_admin(request):
        raise ApiError("loading and unloading LoRA adapters needs the admin role", status=403)
    loras = request.app[FRONT].loras
    if loras is None:
        raise ApiError("LoRA is off on this server: start it with --max-loras N", "lora_name")
    return loras


async def _body(request: web.Request, kind: type) -> Any:
    try:
        return msgspec.json.decode(await read_body(request), type=kind)
    except msgspec.ValidationError as e:
        field = str(e).rpartition("$.")[2].rstrip("`") or None
        raise ApiError(f"invalid body: {e}", param=field) from e
    except msgspec.DecodeError as e:
        raise ApiError(f"the body is not JSON: {e}") from e


async def load_lora_adapter(request: web.Request) -> web.Response:
    loras = _registry(request)
    body = await _body(request, LoadBody)
    try:
        loras.load(body.lora_name, body.lora_path)
    except LoraLoadError as e:
        raise ApiError(str(e), param=e.field) from e
    message = f"Success: LoRA adapter '{body.lora_name}' added successfully."
    return _answer(request, message)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """409 naming the requests that still use the adapter; 404 for one not loaded."""
    loras = _registry(request)
    body = await _body(request, UnloadBody)
    if body.lora_name not in loras:
        raise ApiError(str(UnknownLora(body.lora_name)), "lora_name", 404, code="lora_not_found")
    users = request.app[FRONT].requests_using_lora(body.lora_name)
    if users:
        raise ApiError(
            f"LoRA adapter {body.lora_name!r} is in use by requests {', '.join(users[:16])}",
            "lora_name",
            409,
        )
    loras.unload(body.lora_name)
    return _answer(request, f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _answer(request: web.Request, message: str) -> web.Response:
    """vLLM answers its routes in plain text, SGLang in JSON."""
    if request.path.startswith("/v1/"):
        return web.Response(text=message)
    return json_response({"success": True, "message": message})


def add_lora_routes(app: web.Application) -> None:
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/load_lora_adapter", load_lora_adapter)
        app.router.add_post(f"{prefix}/unload_lora_adapter", unload_lora_adapter)
