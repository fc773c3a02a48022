"""Connection hygiene, with raw sockets: slow request heads and bodies are cut off, idle
connections close, connections over the cap are refused cheaply while the server keeps
serving (under a 1024 open-file limit), a half-closed complete request is answered, and
deeply nested JSON is a 400 naming the field."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import serving

from radixrt.server.connections import (
    FD_RESERVE,
    ConnectionLimits,
    connection_cap,
    raise_fd_limit,
)

HEADER_S, BODY_S, IDLE_S = 1.0, 1.0, 4.0
NOFILE = 1024
CAP = NOFILE - FD_RESERVE
GEN = {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def test_limits_and_cap():
    with pytest.raises(ValueError, match="header_timeout_s"):
        ConnectionLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections"):
        ConnectionLimits(max_connections=0)
    limits = ConnectionLimits(max_connections=5000)
    assert connection_cap(limits, 1024) == 1024 - FD_RESERVE  # below the open-file limit
    assert connection_cap(limits, 1_000_000) == 5000
    with pytest.raises(ValueError, match="no room"):
        connection_cap(limits, FD_RESERVE)
    assert raise_fd_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = (
        "--header-timeout", str(HEADER_S), "--body-timeout", str(BODY_S),
        "--keep-alive-timeout", str(IDLE_S), "--log-level", "info",
    )  # fmt: skip
    # the soft limit is raised to the hard one at start
    with serving(tiny_model_dir, *args, nofile=(256, NOFILE)) as srv:
        yield srv


def connect(srv, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)


def request_bytes(path: str, body: object, extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n{extra}\r\n"
    )
    return head.encode() + data


def read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything until the server closes (or resets) the connection."""
    sock.settimeout(timeout)
    buf = b""
    try:
        while chunk := sock.recv(65536):
            buf += chunk
    except ConnectionResetError:
        pass
    return buf


def closed_after(sock: socket.socket, timeout: float) -> float:
    """Seconds until the server closes `sock` (reading and dropping what it sends)."""
    t0 = time.monotonic()
    read_all(sock, timeout)
    return time.monotonic() - t0


def metric(srv, name: str, **labels: str) -> float:
    _, text = srv.get("/metrics")
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def num_fds(srv) -> int:
    return len(os.listdir(f"/proc/{srv.proc.pid}/fd"))


def test_open_file_limit_is_raised_to_the_hard_limit(server):
    with open(f"/proc/{server.proc.pid}/limits") as f:
        line = next(ln for ln in f if ln.startswith("Max open files"))
    assert line.split()[3:5] == [str(NOFILE), str(NOFILE)], line


def test_idle_connections_close(server):
    fresh = connect(server)  # sends nothing
    used = connect(server)
    used.sendall(request_bytes("/generate", GEN))
    time.sleep(0.5)
    t0 = time.monotonic()
    assert b"HTTP/1.1 200" in used.recv(65536)
    for sock in (fresh, used):
        assert closed_after(sock, IDLE_S + 5) < IDLE_S + 2
        sock.close()
    assert time.monotonic() - t0 > IDLE_S - 1.5  # not before the keep-alive timeout


def test_slow_request_heads_are_cut_off(server):
    before = metric(server, "radixrt_http_timeouts_total", phase="header")
    socks = [connect(server) for _ in range(50)]
    for s in socks:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    for _ in range(8):  # a header byte now and then: never a complete head
        for s in socks:
            with contextlib.suppress(OSError):  # closed already
                s.sendall(b"X")
        time.sleep(0.2)
    for s in socks:
        closed_after(s, HEADER_S + 5)
        s.close()
    assert time.monotonic() - t0 < HEADER_S + 1.5 < IDLE_S  # the head deadline, not idle
    assert metric(server, "radixrt_http_timeouts_total", phase="header") - before == 50
    assert server.get("/health")[0] == 200


def test_slow_request_bodies_get_408(server):
    before = metric(server, "radixrt_http_timeouts_total", phase="body")
    socks = [connect(server) for _ in range(20)]
    data = request_bytes("/generate", GEN)
    for s in socks:
        s.sendall(data[:-20])  # the head and part of the body
    t0 = time.monotonic()
    for s in socks:
        s.settimeout(BODY_S + 5)
        head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"did not arrive within" in head or b"did not arrive within" in s.recv(65536)
        s.close()
    assert time.monotonic() - t0 < BODY_S + 2
    assert metric(server, "radixrt_http_timeouts_total", phase="body") - before == 20


@pytest.mark.parametrize("stream", [False, True])
def test_half_closed_request_is_answered(server, stream):
    sock = connect(server)
    sock.sendall(request_bytes("/generate", {**GEN, "stream": stream}))
    sock.shutdown(socket.SHUT_WR)  # the request is complete: nothing more to send
    out = read_all(sock)  # the server closes once it has answered
    sock.close()
    assert out.count(b"HTTP/1.1 100 Continue") <= 1 and b"HTTP/1.1 200 OK" in out, out
    if stream:
        assert b"data: [DONE]" in out and out.endswith(b"0\r\n\r\n"), out[-200:]  # chunked
    else:
        body = json.loads(out.split(b"\r\n\r\n")[-1])
        assert body["meta_info"]["finish_reason"] == {"type": "length"}
    server.wait_idle()


def test_connections_over_the_cap_are_refused_and_the_server_keeps_serving(server):
    refused_before = metric(server, "radixrt_http_connections_refused_total")
    held = []
    try:
        for _ in range(CAP + 40):
            held.append(connect(server))
        time.sleep(0.5)
        assert num_fds(server) < NOFILE
        status, body = server.get("/health")  # a new connection over the cap
        assert status == 503 and "too many open connections" in body["error"]["message"]
        # the first CAP connections are served; later ones get a 503 or are closed
        refused = 0
        for s in held[-30:]:
            out = read_all(s, timeout=5)
            assert out == b"" or out.startswith(b"HTTP/1.1 503"), out
            refused += 1
        served = held[0]
        served.sendall(request_bytes("/generate", GEN, "Connection: close\r\n"))
        assert b"HTTP/1.1 200 OK" in read_all(served)
    finally:
        for s in held:
            s.close()
    assert metric(server, "radixrt_http_connections_refused_total") - refused_before >= refused
    deadline = time.monotonic() + 10
    while metric(server, "radixrt_http_connections") > 1:  # the /metrics call's own
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert server.post("/generate", GEN)[0] == 200


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("depth", [500, 1000, 20_000])
def test_deep_json_schema_is_400_naming_the_field(server, depth):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "json_schema": nested(depth)}}
    status, out = server.post("/generate", body)
    assert status == 400, out
    assert out["error"]["param"] == "sampling_params.json_schema", out
    raw = b'{"text": "hi", "sampling_params": {"json_schema": ' + nested(depth).encode() + b"}}"
    status, out = server.post("/generate", raw)
    assert status == 400 and out["error"]["param"] == "sampling_params.json_schema", out
    chat = (
        '{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
        '"json_schema", "json_schema": {"name": "a", "schema": ' + nested(depth) + "}}}"
    )
    status, out = server.post("/v1/chat/completions", chat.encode())
    assert status == 400 and "json_schema" in out["error"]["param"], out
    assert server.get("/health")[0] == 200
