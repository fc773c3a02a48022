"""The storage tier on a live server with a real redis-server (tests/redis_server.py): a
restarted server finds the prefixes the first one stored and answers the same; when Redis
dies mid-run every request still succeeds (computed instead) and /metrics counts the
errors; the two replicas of `serve --dp 2` on one store find each other's prefixes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from redis_server import redis_server  # noqa: F401 (a fixture)
from server_utils import free_port, http_call, serving
from test_dp import REPLICA_LINE, _wait, needs_router

PROMPTS = [f"{w}: a long and winding introduction that fills several KV blocks. " * 3
           for w in ("Alpha", "Bravo", "Charlie", "Delta")]  # fmt: skip
BLOCK = 16  # the server's default block size: what distinct prompts share is less


def generate(srv, text, **extra):
    body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **extra}
    status, out = http_call(srv.url + "/generate", body)
    assert status == 200, out
    return out["text"], out["meta_info"]["cached_tokens"]


def metric(srv, name):
    status, text = http_call(srv.url + "/metrics", None, method="GET")
    assert status == 200
    found = re.search(rf"^{name}(?:_total)?\s+(\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_restart_then_redis_dies_mid_run(tiny_model_dir, redis_server):  # noqa: F811
    args = ("--kv-storage", redis_server.url, "--host-kv-gb", "0.05")
    args += ("--kv-storage-prefetch-timeout-s", "60")
    with serving(tiny_model_dir, *args) as srv:
        first = [generate(srv, p) for p in PROMPTS[:2]]
        assert all(c < BLOCK for _, c in first)
        # the answers to come, under a salt whose pages the later requests cannot use
        want_later = [generate(srv, p, cache_salt="other")[0] for p in PROMPTS[2:]]
    with serving(tiny_model_dir, *args) as srv:
        again = [generate(srv, p) for p in PROMPTS[:2]]
        assert [t for t, _ in again] == [t for t, _ in first]
        assert all(c > 3 * BLOCK for _, c in again)  # found in Redis after the restart
        assert metric(srv, "radixrt_storage_hits") > 0
        redis_server.stop()
        later = [generate(srv, p) for p in PROMPTS[2:]]  # computed; writes fail
        assert all(c < BLOCK for _, c in later)
        assert [t for t, _ in later] == want_later
        assert metric(srv, "radixrt_storage_errors") > 0


@needs_router
def test_dp_replicas_share_one_store(tiny_model_dir, redis_server):  # noqa: F811
    """A prefix replica 0 computed is read from Redis by replica 1 (asked directly, so the
    router's cache-aware choice does not send it back to replica 0): the same answer, with
    the prompt's full pages cached and counted as storage hits."""
    port = free_port()
    log_file = tempfile.NamedTemporaryFile(prefix="radixrt-dp-l3-", suffix=".log")  # noqa: SIM115
    log = Path(log_file.name)
    cmd = [
        sys.executable, "-m", "radixrt.cli", "serve", "--model", tiny_model_dir, "--dp", "2",
        "--port", str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "info",
        "--kv-storage", redis_server.url, "--host-kv-gb", "0.05",
        "--kv-storage-prefetch-timeout-s", "60",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=dict(os.environ),
                            start_new_session=True)  # fmt: skip
    try:
        _wait(lambda: "serving on" in log.read_text(), "'serving on' line", log)
        urls = {int(i): u for i, u, _ in REPLICA_LINE.findall(log.read_text())}
        one, two = SimpleNamespace(url=urls[0]), SimpleNamespace(url=urls[1])  # as `srv`
        text, cached = generate(one, PROMPTS[0])
        assert cached < BLOCK
        _wait(lambda: metric(one, "radixrt_storage_written_pages") >= 3, "pages in Redis", log)
        again, cached = generate(two, PROMPTS[0])
        assert again == text and cached > 3 * BLOCK
        assert metric(two, "radixrt_storage_hits") >= 3
        assert metric(two, "radixrt_storage_written_pages") == 0  # it computed nothing to store
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log_file.close()
