"""A scheduler that is alive but makes no progress (stopped, deadlocked, stuck in a call) is
noticed: with work in flight and no message past the stall timeout, /health answers 503,
in-flight and new requests fail with 503 naming the cause, a counter counts it; progress
makes the server healthy again. An idle scheduler is healthy however long it is quiet."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import serving

from radixrt.server.liveness import HEARTBEAT_S, Liveness, StallPolicy

STALL_S = 2.5


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_liveness_counts_silence_only_while_there_is_work():
    clock = Clock()
    live = Liveness(StallPolicy(timeout_s=10, warmup_timeout_s=50), clock)
    clock.now += 1000  # idle for long: healthy
    assert live.check(has_work=False) is None
    live.on_work_sent(had_work=False)  # the clock starts when work arrives
    clock.now += 49
    assert live.check(has_work=True) is None  # warm-up limit: 50 s
    clock.now += 2
    assert live.check(has_work=True) == 51 and live.stalled
    assert live.check(has_work=False) == 51  # reported: stays stalled
    assert live.on_message() == 51 and not live.stalled
    live.on_finished()  # warm: the 10 s limit from now on
    live.on_work_sent(had_work=False)
    clock.now += 10
    assert live.check(has_work=True) is None
    live.on_work_sent(had_work=True)  # more work while busy does not reset the clock
    clock.now += 0.5
    assert live.check(has_work=True) == 10.5
    assert live.stalled_for_s == 10.5


def test_a_warm_scheduler_is_reported_stuck_within_30_s_by_default():
    """A load balancer's probe budget: 30 s after warm-up (the warm-up limit stays long)."""
    clock = Clock()
    live = Liveness(StallPolicy(), clock)
    live.on_finished()
    live.on_work_sent(had_work=False)
    clock.now += 30.5
    assert live.check(has_work=True) is not None and live.stalled
    assert StallPolicy().warmup_timeout_s >= 300


def test_stall_policy_checks_its_values():
    with pytest.raises(ValueError, match="heartbeat"):
        StallPolicy(timeout_s=HEARTBEAT_S)
    with pytest.raises(ValueError, match="at least"):
        StallPolicy(timeout_s=10, warmup_timeout_s=5)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = ("--stall-timeout", str(STALL_S), "--stall-timeout-warmup", str(STALL_S))
    with serving(tiny_model_dir, *args) as srv:
        yield srv


def metric(srv, name: str) -> float:
    status, text = srv.get("/metrics")
    assert status == 200
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no metric {name}")


GEN = {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def test_idle_is_healthy_and_long_generations_are_progress(server):
    assert server.post("/generate", GEN)[0] == 200
    time.sleep(STALL_S + 1.5)  # quiet, nothing in flight
    assert server.get("/health")[0] == 200
    # work in flight for longer than the stall timeout: every step is progress
    body = {"text": "go", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    deadline = time.monotonic() + STALL_S + 1.5
    statuses = []

    def client():
        while time.monotonic() < deadline:
            statuses.append(server.post("/generate", body)[0])

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        assert server.get("/health")[0] == 200
        time.sleep(0.2)
    assert statuses and set(statuses) == {200}
    assert metric(server, "radixrt_scheduler_stalls_total") == 0


def test_a_stopped_scheduler_is_noticed_and_recovers(server):
    pid = server.state()["scheduler_pid"]
    result = []
    os.kill(pid, signal.SIGSTOP)
    try:
        assert server.get("/health")[0] == 200  # nothing in flight yet
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: result.append(server.post("/generate", GEN)))
        t.start()
        t.join(STALL_S + 5)  # the in-flight request fails once the stall is noticed
        waited = time.monotonic() - t0
        assert not t.is_alive() and STALL_S <= waited < STALL_S + 3, waited
        status, body = result[0]
        assert status == 503 and "stalled" in body["error"]["message"], body
        status, body = server.get("/health")
        assert status == 503 and body["status"] == "scheduler_stalled", body
        assert "no progress" in body["detail"]
        t1 = time.monotonic()
        status, body = server.post("/generate", GEN)
        assert status == 503 and "stalled" in body["error"]["message"], body
        assert time.monotonic() - t1 < 1.0  # fails fast
        assert metric(server, "radixrt_scheduler_stalls_total") == 1
        assert metric(server, "radixrt_scheduler_stalled") == 1
        assert metric(server, "radixrt_ready") == 0
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while server.get("/health")[0] != 200:
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.05)
    assert server.post("/generate", GEN)[0] == 200
    assert metric(server, "radixrt_scheduler_stalled") == 0
    assert metric(server, "radixrt_ready") == 1
    log = server.output(None)
    assert "made no progress for" in log and "made progress again" in log
    server.wait_idle()  # the failed request's KV was freed once the scheduler ran
