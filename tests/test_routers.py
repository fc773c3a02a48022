"""Two `radixrt serve` replicas behind the real sglang-router (cache_aware and round_robin
policies): the
router accepts them as workers, and the chat, completion and /generate requests it
forwards (with the fields it adds) succeed, on both replicas. Skipped without
sglang-router (`pip install sglang-router==0.3.2`)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from server_utils import ServerProcess, free_port, http_call, sse_events

# (module, pip package, pinned version, policy, --log-level value)
ROUTERS = [
    ("sglang_router", "sglang-router", "0.3.2", "cache_aware", "warn"),
    ("sglang_router", "sglang-router", "0.3.2", "round_robin", "warn"),
    ("vllm_router", "vllm-router", "0.1.17", "round_robin", "warning"),
]
ROUTER_READY_S = 60.0


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    servers = [ServerProcess(tiny_model_dir, "--log-level", "info") for _ in range(2)]
    try:
        for s in servers:
            s.wait_ready()
        yield servers
        for s in servers:
            s.wait_idle(timeout=10)
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module", params=ROUTERS, ids=[f"{r[1]}-{r[3]}" for r in ROUTERS])
def router(replicas, request):
    module, package, pinned, policy, log_level = request.param
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{package} is not installed (pip install {package}=={pinned})")
    from importlib.metadata import version

    assert version(package) == pinned, version(package)
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log")  # noqa: SIM115
    cmd = [
        sys.executable, "-m", f"{module}.launch_router", "--host", "127.0.0.1",
        "--port", str(port), "--policy", policy, "--log-level", log_level,
        "--worker-urls", *(s.url for s in replicas),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    POLICIES[url] = policy
    try:
        deadline = time.monotonic() + ROUTER_READY_S
        while True:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            with contextlib.suppress(OSError):
                status, body = http_call(url + "/v1/models", None, method="GET", timeout=5)
                if status == 200 and body.get("data"):
                    break
            assert time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


POLICIES: dict[str, str] = {}  # router url -> its policy


def router_policy(url: str) -> str:
    return POLICIES[url]


def generated(server: ServerProcess) -> int:
    return server.state()["scheduler"]["generated_tokens"]


def test_routed_requests_succeed_on_both_replicas(router, replicas):
    status, models = http_call(router + "/v1/models", None, method="GET")
    model = models["data"][0]["id"]  # the router's completions route needs a model
    before = [generated(s) for s in replicas]
    prompts = [f"Request {i}: tell me about topic number {i * 7919}" for i in range(12)]
    for i, text in enumerate(prompts):
        # chat without `model` (the router sends "unknown"), completions, /generate
        status, out = http_call(
            router + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": text}], "max_tokens": 4},
        )
        assert status == 200, out
        assert out["choices"][0]["message"]["role"] == "assistant"
        body = {"model": model, "prompt": text, "max_tokens": 4}
        status, out = http_call(router + "/v1/completions", body)
        assert status == 200 and out["usage"]["completion_tokens"] <= 4, out
        body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        status, out = http_call(router + "/generate", body)
        assert status == 200 and out["meta_info"]["completion_tokens"] <= 4, out
        if i % 4 == 0:
            events = list(
                sse_events(
                    router + "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": text}], "max_tokens": 4,
                     "stream": True, "stream_options": {"include_usage": True}},
                )
            )  # fmt: skip
            assert events[-1]["usage"]["completion_tokens"] <= 4
    after = [generated(s) for s in replicas]
    assert sum(after) > sum(before)
    if "round_robin" in router_policy(router):
        assert all(a > b for a, b in zip(after, before)), (before, after)
    for s in replicas:  # (the router's HTTP/2 probe logs aiohttp parser errors: not ours)
        log = s.output(None)
        assert "internal error" not in log and "rejected" not in log, log[-3000:]
