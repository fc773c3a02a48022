"""The storage tier on a live server with a real redis-server (tests/redis_server.py): a
restarted server finds the prefixes the first one stored and answers the same; when Redis
dies mid-run every request still succeeds (computed instead) and /metrics counts the
errors."""

from __future__ import annotations

import re

from redis_server import redis_server  # noqa: F401 (a fixture)
from server_utils import http_call, serving

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
