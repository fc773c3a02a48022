"""A worker fault is the server's, not the client's: when the grammar compiler dies,
/health fails, the fault is logged once, requests that need a grammar get 503 with
Retry-After (a router takes the replica out), and requests that need none are served."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from server_utils import serving

pytest.importorskip("xgrammar")

REGEX = {"text": "x", "sampling_params": {"max_new_tokens": 4, "regex": "[0-9]+"}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir) as srv:
        yield srv


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def post(srv, path: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(
        srv.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_a_dead_grammar_compiler_is_503_and_health_fails(server):
    assert post(server, "/generate", REGEX)[0] == 200  # the compiler is up
    scheduler = server.state()["scheduler_pid"]
    template = [p for p in children(scheduler) if b"-c" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(template) == 1, template
    os.kill(template[0], signal.SIGKILL)
    # The pool learns of the death from the template's socket; until then a surviving
    # worker may still compile (and correctly serve) a grammar, so wait for /health first:
    # an idle scheduler sends fresh stats every 2 s, so no request is needed to see it.
    deadline = time.monotonic() + 10
    while server.get("/health")[0] == 200:
        assert time.monotonic() < deadline, "/health missed the dead compiler for 10 s"
        time.sleep(0.2)
    # a new grammar (the cache has the first one) needs the compiler
    body = {"text": "x", "sampling_params": {"max_new_tokens": 4, "regex": "[a-c]+"}}
    status, headers, out = post(server, "/generate", body)
    assert status == 503, out
    assert headers.get("Retry-After") == "5" and out["error"]["type"] == "server_error"
    for pattern in ("[d-f]+", "[g-i]+"):
        body = {"text": "x", "sampling_params": {"max_new_tokens": 4, "regex": pattern}}
        assert post(server, "/generate", body)[0] == 503
    status, health = server.get("/health")
    assert status == 503 and health["status"] == "grammar_unavailable", health
    plain = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    assert post(server, "/generate", plain)[0] == 200  # no grammar: served
    log = server.output(None)
    assert log.count("the grammar compiler exited") == 1, log[-3000:]
