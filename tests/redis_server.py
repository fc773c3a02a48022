"""A throwaway redis-server for the storage tests: Debian's binary on a free port in a
temporary directory, no persistence; tests skip when the binary is absent."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; `stop` kills it, `start` brings it back on the same port
    (empty: it keeps nothing on disk)."""

    def __init__(self, workdir: Path, maxmemory: str = "256mb") -> None:
        self.workdir = workdir
        self.port = free_port()
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.workdir), "--save", "", "--appendonly", "no"]
        args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert self.proc.poll() is None, f"redis-server exited: {self.proc.returncode}"
                time.sleep(0.02)
        raise TimeoutError(f"redis-server did not listen on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def redis_server(tmp_path_factory):
    """A running `RedisServer` (killed at teardown)."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
