"""The `--dp` front (radixrt.server.dp_front) against stand-in upstreams, and sglang-router
as `serve --dp` configures it against stand-in workers: no model, no replicas.

- the router's management routes answer only an admin key (none without keys); tenant keys
  and no key never reach them, under any spelling of the path;
- a completion without `model` gets the served model's name; a list `text` /generate is one
  request per prompt, its outputs one list in order;
- tenant control routes reach every replica with the caller's key, answers summed;
- one client's 5xx does not take a replica out of the router for everyone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import time

import pytest
from aiohttp import web
from server_utils import free_port, http_call

from radixrt.server import dp
from radixrt.server.dp_front import FrontThread, Upstreams, create_front_app
from radixrt.server.launch import ServeConfig
from radixrt.server.tenants import Tenants

ADMIN, ALICE = "admin-key-0123456789", "alice-key-0123456789"


class Upstream:
    """A stand-in router or replica on loopback that records what reaches it."""

    def __init__(self, name: str, answer=None) -> None:
        self.name = name
        self.seen: list[tuple[str, str, str | None, dict | None]] = []  # method, path, auth, body
        self.answer = answer or (lambda path, body: {"from": name, "path": path})
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = FrontThread(app, "127.0.0.1", self.port)
        self.thread.start()

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.seen.append((request.method, request.path, request.headers.get("Authorization"), body))
        status, out = 200, self.answer(request.path, body)
        if isinstance(out, tuple):
            status, out = out
        return web.json_response(out, status=status)


def _replica_answer(path: str, body: dict | None):
    return {
        "/abort": {"rid": body and body.get("rid"), "aborted": 1},
        "/flush_cache": {"success": True, "freed_blocks": 3},
        "/cache_pressure": {"block_size": 16, "held_blocks": 2, "held": ["r1"]},
        "/kv_event_sources": [{"endpoint": "tcp://127.0.0.1:1"}],
    }.get(path, {"path": path})


def _router_answer(path: str, body: dict | None):
    if path == "/generate" and isinstance(body, dict):
        if isinstance(body.get("text"), list):
            return 422, {"error": "text: invalid type: sequence"}  # as sglang-router 0.3.2
        return {"text": f"<{body.get('text')}>", "meta_info": {"id": body.get("rid")}}
    return {"path": path, "body": body}


@contextlib.contextmanager
def front(api_key=None, tenants=None):
    router = Upstream("router", _router_answer)
    replicas = [Upstream(f"r{i}", _replica_answer) for i in range(2)]
    ups = Upstreams(router.url, tuple(r.url for r in replicas), router.url + "/metrics", "tiny")
    port = free_port()
    thread = FrontThread(create_front_app(ups, api_key, tenants), "127.0.0.1", port)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", router, replicas
    finally:
        for t in (thread, router.thread, *(r.thread for r in replicas)):
            t.stop()


def call(url, path, body=None, key=None, method=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http_call(
        url + path, body, headers, method=method or ("GET" if body is None else "POST")
    )


TAKEOVER = [
    ("POST", "/workers", {"url": "http://127.0.0.1:9"}),
    ("DELETE", "/workers/0b7c9e54-5a43-4e2b-8f6c-1f9f3c1d2e3a", None),
    ("GET", "/workers", None),
    ("POST", "/add_worker?url=http://127.0.0.1:9", None),
    ("POST", "/remove_worker?url=http://127.0.0.1:1", None),
    ("GET", "/list_workers", None),
    ("GET", "/get_loads", None),
    ("GET", "//workers", None),
    ("GET", "/workers/", None),
    ("GET", "/%77orkers", None),
]


@pytest.mark.parametrize("keys", ["none", "api_key", "tenants"])
def test_management_routes_need_an_admin_key(keys):
    tenants = Tenants({ADMIN: "ops", ALICE: "alice"}, frozenset({ADMIN}))
    api_key = {"none": None, "api_key": ADMIN, "tenants": "shared-key-0123456789"}[keys]
    with front(api_key, tenants if keys == "tenants" else None) as (url, router, _):
        for method, path, body in TAKEOVER:
            for key in (None, ALICE, "shared-key-0123456789"):
                status, out = call(url, path, body, key, method)
                assert status in (401, 403, 404), (keys, key, path, status, out)
        assert not any("worker" in p or "load" in p for _, p, _, _ in router.seen)
        status, out = call(url, "/workers", key=ADMIN)
        assert status == (403 if keys == "none" else 200), out
        assert status == 403 or router.seen[-1][:2] == ("GET", "/workers")


def test_requests_without_model_and_batched_generate():
    with front() as (url, router, _):
        status, out = call(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and out["body"]["model"] == "tiny", out
        status, out = call(url, "/v1/chat/completions", {"model": "mine", "messages": []})
        assert out["body"]["model"] == "mine"  # a client's model is kept
        body = {"text": ["a", "b", "c"], "rid": ["x", "y", "z"], "sampling_params": {}}
        status, out = call(url, "/generate", body)
        assert status == 200, out
        assert [o["text"] for o in out] == ["<a>", "<b>", "<c>"]
        assert [o["meta_info"]["id"] for o in out] == ["x", "y", "z"]
        assert call(url, "/generate", {"text": "a"})[1]["text"] == "<a>"


def test_control_routes_reach_every_replica_with_the_callers_key():
    tenants = Tenants({ADMIN: "ops", ALICE: "alice"}, frozenset({ADMIN}))
    with front(None, tenants) as (url, _, replicas):
        status, out = call(url, "/abort", {"rid": "job"}, ALICE)
        assert (status, out["aborted"]) == (200, 2), out
        status, out = call(url, "/flush_cache", {}, ALICE)
        assert out == {"success": True, "freed_blocks": 6, "replicas_unreachable": 0}
        out = call(url, "/cache_pressure", key=ALICE)[1]
        assert (out["block_size"], out["held_blocks"], out["held"]) == (16, 4, ["r1"])
        for r in replicas:
            assert {(m, p, a) for m, p, a, _ in r.seen} == {
                ("POST", "/abort", f"Bearer {ALICE}"),
                ("POST", "/flush_cache", f"Bearer {ALICE}"),
                ("GET", "/cache_pressure", f"Bearer {ALICE}"),
            }
        assert call(url, "/abort", {"rid": "job"})[0] == 401
        assert call(url, "/metrics", key=ALICE)[0] == 403
        assert call(url, "/kv_event_sources", key=ALICE)[0] == 403
        status, out = call(url, "/kv_event_sources", key=ADMIN)
        assert status == 200 and len(out) == 2
        assert call(url, "/debug/state", key=ADMIN)[0] == 404  # a replica's own port only


needs_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"
)


def _worker_answer(port: int):
    def answer(path: str, body: dict | None):
        if path in ("/get_server_info", "/get_model_info", "/server_info", "/model_info"):
            return {"model_path": "m", "served_model_name": "m", "tokenizer_path": "m"}
        if path == "/v1/models":
            return {"object": "list", "data": [{"id": "m", "object": "model"}]}
        if path == "/generate":
            if body.get("text") == "boom":  # a request that makes its replica fail
                return 500, {"error": {"message": "internal error"}}
            return {"text": f"ok from {port}", "meta_info": {"id": "1"}}
        return {"status": "ok"}

    return answer


@needs_router
def test_one_clients_5xx_takes_no_replica_out():
    workers = [Upstream(f"w{i}") for i in range(2)]
    for w in workers:
        w.answer = _worker_answer(w.port)
    port, prom = free_port(), free_port()
    cfg = ServeConfig(model="m")
    cmd = dp.router_command(cfg, dp.DPOptions(2), [w.url for w in workers], port, prom)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
    router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                status, out = http_call(url + "/workers", None, method="GET", timeout=2)
                if status == 200 and len(out["workers"]) == 2:
                    break
            assert time.monotonic() < deadline, "the router did not list both workers"
            time.sleep(0.25)
        for _ in range(12):  # sglang-router's defaults open both breakers after four
            assert http_call(url + "/generate", {"text": "boom"})[0] == 500
        status, out = http_call(url + "/generate", {"text": "fine"})
        assert status == 200 and out["text"].startswith("ok"), out
        booms = [sum((b or {}).get("text") == "boom" for _, _, _, b in w.seen) for w in workers]
        assert sum(booms) == 12  # not retried on the other replica
        # the launcher registers again a replica removed from the router's list
        wid = next(x["id"] for x in out_workers(url) if x["url"] == workers[0].url)
        assert http_call(url + f"/workers/{wid}", None, method="DELETE")[0] in (200, 202)
        wait_for(lambda: workers[0].url not in [x["url"] for x in out_workers(url)])
        assert dp.restore_workers(url, [w.url for w in workers]) == [workers[0].url]
        wait_for(lambda: workers[0].url in [x["url"] for x in out_workers(url)])
    finally:
        router.terminate()
        router.wait(15)
        for w in workers:
            w.thread.stop()


def out_workers(url: str) -> list[dict]:
    return http_call(url + "/workers", None, method="GET", timeout=5)[1]["workers"]


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_fan_out_answers_merge_nested_counters():
    """Replicas' dicts (per-adapter or per-tenant counters) are summed key by key, not the
    first replica's kept."""
    from radixrt.server.dp_front import _merge

    a = {"block_size": 16, "held_blocks": 2, "by_lora": {"x": 1, "y": 2}, "ok": True}
    b = {"block_size": 16, "held_blocks": 3, "by_lora": {"y": 5, "z": 1}, "ok": False}
    assert _merge([a, b], "/cache_pressure", 1) == {
        "block_size": 16,
        "held_blocks": 5,
        "by_lora": {"x": 1, "y": 7, "z": 1},
        "ok": False,
        "replicas_unreachable": 1,
    }
