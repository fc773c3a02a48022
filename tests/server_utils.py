"""Helpers for the server tests: a live `radixrt serve` in a subprocess on a free loopback
port, small HTTP/SSE clients with timeouts, and process checks."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HTTP_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`radixrt serve` (CPU, float32, debug endpoints) in its own session, so teardown can
    kill the front and the scheduler child by process group."""

    def __init__(
        self,
        model_dir: str | None,
        *args: str,
        api_key: str | None = None,
        nofile: tuple[int, int] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        """`model_dir` None: no --model (the server's default, the tiny model); `nofile`: the
        (soft, hard) open-file limit the server starts with; `env`: extra environment
        variables; `cwd`: the working directory it starts in (default: this process's)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.seen_loading = False  # wait_ready saw /health answer 503 "loading"
        cmd = [
            sys.executable, "-m", "radixrt.cli", "serve",
            *(() if model_dir is None else ("--model", model_dir)),
            "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
            "--enable-debug-endpoints", "--log-level", "warning", *args,
        ]  # fmt: skip
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, **(env or {})}
        # a private TMPDIR: the test can see what the server leaves in it (ipc dirs)
        self.tmpdir = tempfile.mkdtemp(prefix="radixrt-test-tmp-")
        env["TMPDIR"] = self.tmpdir
        # closed by kill_group(), which every test teardown reaches through stop()
        self.log = tempfile.NamedTemporaryFile(prefix="radixrt-serve-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=None if nofile is None else lambda: _set_nofile(nofile),
        )

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(OSError):
                status, body = self.get("/health", timeout=2)
                if status == 200:
                    return
                if status == 503 and body["status"] == "loading":
                    self.seen_loading = True
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.output()}")

    def ipc_dirs(self) -> list[str]:
        """The server's radixrt-ipc-* dirs still in its TMPDIR."""
        return sorted(p.name for p in Path(self.tmpdir).glob("radixrt-ipc-*"))

    def output(self, tail: int | None = 5000) -> str:
        """The server's log (its last `tail` characters; None: all of it)."""
        text = Path(self.log.name).read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, timeout: float = HTTP_TIMEOUT_S) -> tuple[int, Any]:
        return http_call(self.url + path, None, self.headers(), timeout, method="GET")

    def post(self, path: str, body: Any, timeout: float = HTTP_TIMEOUT_S) -> tuple[int, Any]:
        return http_call(self.url + path, body, self.headers(), timeout)

    def state(self) -> dict[str, Any]:
        status, body = self.get("/debug/state", timeout=5)
        assert status == 200, body
        return body

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """Until nothing runs, waits or holds KV (front and scheduler); integrity holds."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            snap = st["scheduler"]
            idle = st["in_flight"] == 0 and (
                snap is None
                or (snap["running"] == 0 and snap["waiting"] == 0 and snap["kv_blocks_in_use"] == 0)
            )
            if idle:
                assert snap is None or snap["integrity_error"] is None, snap["integrity_error"]
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {st}")
            time.sleep(0.05)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the front and wait; SIGKILL the whole group if anything lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill_group()
        return self.proc.returncode

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _set_nofile(limits: tuple[int, int]) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, limits)


@contextlib.contextmanager
def serving(
    model_dir: str | None,
    *args: str,
    api_key: str | None = None,
    nofile: tuple[int, int] | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
):
    """A ready `ServerProcess` (the usual module fixture's body): on leaving, it must go
    idle (nothing in flight, integrity holds) and is stopped."""
    srv = ServerProcess(model_dir, *args, api_key=api_key, nofile=nofile, env=env, cwd=cwd)
    try:
        srv.wait_ready()
        yield srv
        srv.wait_idle()
    finally:
        srv.stop()


def http_call(
    url: str,
    body: Any,
    headers: dict[str, str] | None = None,
    timeout: float = HTTP_TIMEOUT_S,
    method: str = "POST",
) -> tuple[int, Any]:
    """(status, parsed JSON or text). `body`: JSON-able, or bytes sent as is."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, _parse(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, _parse(e.read())


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def sse_events(url: str, body: Any, headers: dict | None = None, timeout: float = 30.0):
    """Yield the JSON events of an SSE POST until `data: [DONE]` (asserted to arrive)."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                return
            yield json.loads(line[6:])
    raise AssertionError("stream ended without data: [DONE]")


def open_raw_stream(port: int, path: str, body: Any) -> socket.socket:
    """Send a POST on a raw socket (the test can read a little, then drop the connection)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    buf = b""
    while marker not in buf:
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
    return buf


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)
