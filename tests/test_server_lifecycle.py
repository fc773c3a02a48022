"""Process lifecycle: SIGTERM stops both processes; a dead scheduler turns into 503s and
failed streams (no hang); a dead front takes the scheduler with it (no orphans)."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerProcess, pid_alive, sse_events, wait_dead

LONG = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    """Three servers, started together (their start-up overlaps)."""
    procs = [ServerProcess(tiny_model_dir) for _ in range(3)]
    try:
        waits = [threading.Thread(target=p.wait_ready) for p in procs]  # each from its start
        for t in waits:
            t.start()
        for t in waits:
            t.join()
        for p in procs:
            p.wait_ready()  # raises if one did not come up
        yield procs
    finally:
        for p in procs:
            p.kill_group()


def _stream_in_background(srv, events, errors):
    def consume():
        body = {"text": "in flight", "sampling_params": LONG, "stream": True}
        try:
            events.extend(sse_events(srv.url + "/generate", body, timeout=20))
        except Exception as e:  # the stream may also just be cut; record either
            errors.append(e)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events, "no first event"
    return t


def test_health_is_503_until_ready(servers):
    # HTTP is up before the tokenizer and the model load (the front listens first).
    assert all(srv.seen_loading for srv in servers)
    assert all(srv.get("/health")[0] == 200 for srv in servers)


def test_no_ipc_dir_left_once_ready(servers):
    # Both ends are connected once Ready: the socket files go (a killed front leaks none).
    deadline = time.monotonic() + 5
    while any(srv.ipc_dirs() for srv in servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(srv.ipc_dirs() for srv in servers)


def test_port_in_use_is_one_line_and_fails_fast(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "radixrt.cli", "serve", "--model", tiny_model_dir]
        cmd += ["--port", str(port), "--device", "cpu"]
        env = dict(os.environ)
        t0 = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        elapsed = time.monotonic() - t0
    assert out.returncode == 1
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "already in use" in lines[0] and str(port) in lines[0], lines
    assert elapsed < 10


def test_sigterm_stops_both_processes(servers):
    srv = servers[0]
    sched = srv.state()["scheduler_pid"]
    assert pid_alive(sched)
    status, _ = srv.post("/v1/completions", {"prompt": "bye", "max_tokens": 2})
    assert status == 200
    events, errors = [], []
    t = _stream_in_background(srv, events, errors)  # a stream in flight at SIGTERM
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(15) == 0, srv.output()
    assert wait_dead(sched, 5), "scheduler process outlived the front"
    assert time.monotonic() - t0 < 10
    t.join(10)
    assert not t.is_alive()
    assert errors or "shutting down" in events[-1]["error"]["message"]


def test_scheduler_death_gives_503_not_hang(servers):
    srv = servers[1]
    sched = srv.state()["scheduler_pid"]
    events, errors = [], []
    t = _stream_in_background(srv, events, errors)
    os.kill(sched, signal.SIGKILL)
    t.join(15)
    assert not t.is_alive(), "in-flight stream hangs after the scheduler died"
    assert errors or "error" in events[-1], events[-1:]
    if not errors:
        assert "scheduler" in events[-1]["error"]["message"]
    status, body = srv.get("/health")
    assert status == 503 and body["status"] == "scheduler_dead"
    status, text = srv.get("/metrics")
    gauges = {
        m.name: m.samples[0].value
        for m in text_string_to_metric_families(text)
        if m.type == "gauge" and m.samples
    }
    assert gauges["radixrt_ready"] == 0 and gauges["radixrt_front_in_flight"] == 0
    for name in (
        "radixrt_kv_blocks_free",
        "radixrt_kv_blocks_in_use",
        "radixrt_num_requests_running",
    ):
        assert math.isnan(gauges[name]), (name, gauges[name])  # no stale value
    status, body = srv.post("/v1/completions", {"prompt": "anyone?", "max_tokens": 2}, timeout=5)
    assert status == 503 and "scheduler" in body["error"]["message"]
    status, body = srv.post("/generate", {"text": "x"}, timeout=5)
    assert status == 503
    assert srv.stop() == 0, srv.output()


def test_front_death_takes_scheduler_down(servers):
    srv = servers[2]
    sched = srv.state()["scheduler_pid"]
    srv.proc.kill()  # SIGKILL: no cleanup in the front at all
    srv.proc.wait(5)
    assert wait_dead(sched, 5), "scheduler process orphaned after the front died"
    assert srv.ipc_dirs() == []  # removed once the scheduler was Ready


def test_event_loop_choice():
    """auto takes uvloop when it is installed; asyncio is asyncio's default loop; a name
    not listed is refused with what is allowed."""
    from radixrt.server.launch import ServeConfig, event_loop_factory

    assert event_loop_factory("asyncio") is None
    try:
        import uvloop
    except ImportError:
        assert event_loop_factory("auto") is None
        with pytest.raises(ValueError, match="needs the uvloop package"):
            event_loop_factory("uvloop")
    else:
        assert event_loop_factory("auto") is uvloop.new_event_loop
    with pytest.raises(ValueError, match="event_loop must be one of"):
        ServeConfig(model="m", event_loop="trio")
