"""Process lifecycle: SIGTERM stops both processes; a dead scheduler turns into 503s and
failed streams (no hang); a dead front takes the scheduler with it (no orphans)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from server_utils import ServerProcess, pid_alive, sse_events, wait_dead

LONG = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    """Three servers, started together (their start-up overlaps)."""
    procs = [ServerProcess(tiny_model_dir) for _ in range(3)]
    try:
        for p in procs:
            p.wait_ready()
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
    # HTTP is up before the scheduler process has loaded the model (imports take seconds).
    assert any(srv.seen_loading for srv in servers)
    assert all(srv.get("/health")[0] == 200 for srv in servers)


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
