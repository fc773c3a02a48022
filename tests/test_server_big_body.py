"""Big request bodies do not hold up the front: /health answers while a 50 MB body is
posted and refused, a body over the size limit is refused by its Content-Length before it
is sent, and a chat with more messages than the context has tokens is refused before its
template is rendered."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from server_utils import http_call, read_until, serving

from radixrt.server.http_util import MAX_BODY_BYTES

BIG = 50 * 1024 * 1024
HEALTH_BOUND_S = 3.0  # /health while a big body is handled (~0.3 s idle; slack for CI)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir) as srv:
        yield srv


def _health_latencies(server, done: threading.Event) -> list[float]:
    """/health's answer times, polled every 50 ms until `done` is set."""
    latencies = []
    while not done.is_set():
        t = time.perf_counter()
        status, _ = http_call(server.url + "/health", None, method="GET")
        latencies.append(time.perf_counter() - t)
        assert status == 200
        time.sleep(0.05)
    return latencies


def _post_while_polling(server, path: str, body: bytes) -> tuple[int, dict, list[float]]:
    done = threading.Event()
    result: dict = {}

    def post() -> None:
        try:
            result["out"] = http_call(server.url + path, body, timeout=120)
        finally:
            done.set()

    poster = threading.Thread(target=post)
    poster.start()
    latencies = _health_latencies(server, done)
    poster.join()
    status, out = result["out"]
    return status, out, latencies


@pytest.mark.parametrize("shape", ["many_messages", "one_long_message"])
def test_health_answers_while_a_50mb_body_is_posted(server, shape):
    if shape == "many_messages":  # 1.3 M short messages: over the context's message count
        messages = [{"role": "user", "content": "hi"}] * (BIG // 35)
    else:  # 50 M characters: over the context's characters
        messages = [{"role": "user", "content": "a " * (BIG // 2)}]
    body = json.dumps({"messages": messages, "max_tokens": 1}).encode()
    assert len(body) >= BIG
    status, out, latencies = _post_while_polling(server, "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "messages", out
    assert max(latencies) < HEALTH_BOUND_S, latencies
    assert http_call(server.url + "/health", None, method="GET")[0] == 200


def test_more_messages_than_context_tokens_is_400_before_rendering(server):
    messages = [{"role": "user", "content": ""}] * 4097  # the tiny model's context: 2,048
    status, out = http_call(server.url + "/v1/chat/completions", {"messages": messages})
    assert status == 400 and out["error"]["param"] == "messages"
    assert "4097 messages" in out["error"]["message"], out


def test_body_over_the_limit_is_refused_by_its_content_length(server):
    """The 413 arrives before any of the body is sent, and names the limit."""
    length = MAX_BODY_BYTES + 1
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % length
        )
        reply = read_until(sock, b"}}", timeout=10)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:200]
    message = json.loads(body)["error"]["message"]
    assert str(MAX_BODY_BYTES) in message and str(length) in message, message
    assert http_call(server.url + "/health", None, method="GET")[0] == 200
