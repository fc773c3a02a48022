"""The front's event loop does bounded work per request: a request built to cost the server
much (many tools, megabytes of tool text sent gzipped, a stop regex that backtracks) is
refused or cut short while /health and a small request from another client are answered,
and SIGTERM ends the server meanwhile."""

from __future__ import annotations

import contextlib
import gzip
import json
import threading
import time

import pytest
from server_utils import ServerProcess, http_call, serving

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
# /health and a small request answer within this while an attack runs (2 loaded cores)
ANSWER_S = 5.0


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir) as srv:
        yield srv


class Watch:
    """Polls /health and sends a small completion from another thread while the block
    runs; records the slowest answers."""

    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.slowest_health = 0.0
        self.slowest_victim = 0.0
        self.failures: list[str] = []
        self._done = threading.Event()
        self._threads = [
            threading.Thread(target=self._health),
            threading.Thread(target=self._victim),
        ]

    def _timed(self, call) -> float:
        start = time.monotonic()
        try:
            status, body = call()
        except OSError as e:
            self.failures.append(repr(e))
        else:
            if status != 200:
                self.failures.append(f"{status}: {body}")
        return time.monotonic() - start

    def _health(self) -> None:
        while not self._done.is_set():
            took = self._timed(lambda: self.srv.get("/health", timeout=60))
            self.slowest_health = max(self.slowest_health, took)
            time.sleep(0.1)

    def _victim(self) -> None:
        body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
        while not self._done.is_set():
            took = self._timed(lambda: self.srv.post("/v1/completions", body, timeout=60))
            self.slowest_victim = max(self.slowest_victim, took)
            time.sleep(0.2)

    def __enter__(self) -> Watch:
        for t in self._threads:
            t.start()
        time.sleep(0.3)
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        for t in self._threads:
            t.join(120)
        assert not self.failures, self.failures[:3]
        assert self.slowest_health < ANSWER_S, self.slowest_health
        assert self.slowest_victim < ANSWER_S, self.slowest_victim


def many_tools(n: int) -> list[dict]:
    params = {"type": "object", "properties": {"x": {"type": "string"}}}
    return [
        {"type": "function", "function": {"name": f"f{i}", "description": "d" * 60,
                                          "parameters": params}}
        for i in range(n)
    ]  # fmt: skip


def test_200000_tools_are_refused_by_count(server):
    body = {"messages": USER, "tools": many_tools(200_000), "max_tokens": 1}
    with Watch(server):
        status, out = server.post(CHAT, body, timeout=120)
    assert status == 400, out
    assert out["error"]["param"] == "tools"
    assert "512" in out["error"]["message"]


def test_duplicate_tool_names_are_found_at_the_limit(server):
    tools = many_tools(512)
    tools[-1]["function"]["name"] = "f0"
    status, out = server.post(CHAT, {"messages": USER, "tools": tools, "max_tokens": 1})
    assert status == 400 and out["error"]["param"] == "tools[511].function.name", out


def test_gzipped_10mb_description_is_refused_before_tokenizing(server):
    tool = many_tools(1)[0]
    tool["function"]["description"] = "word " * 2_000_000
    body = json.dumps({"messages": USER, "tools": [tool], "max_tokens": 1}).encode()
    data = gzip.compress(body)
    assert len(data) < 100_000
    headers = {"Content-Encoding": "gzip"}
    with Watch(server):
        start = time.monotonic()
        status, out = http_call(server.url + CHAT, data, headers, timeout=120)
        took = time.monotonic() - start
    assert status == 400 and out["error"]["param"] == "tools", out
    assert took < ANSWER_S


def test_history_arguments_count_against_the_context(server):
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": json.dumps({"x": "y" * 2_000_000})}}  # fmt: skip
    messages = [*USER, {"role": "assistant", "content": "", "tool_calls": [call]}]
    status, out = server.post(CHAT, {"messages": messages, "max_tokens": 1})
    assert status == 400 and out["error"]["param"] == "messages", out


def test_catastrophic_stop_regex_is_cut_off_under_forced_output(server):
    """`(a|aa)+c` over a run of forced `a`s backtracks exponentially: the output's search
    budget ends it with a 400 naming the field, and nobody else waits."""
    sp = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True, "regex": "a{200}",
          "stop_regex": "(a|aa)+c"}  # fmt: skip
    with Watch(server):
        status, out = server.post("/generate", {"text": "x", "sampling_params": sp}, timeout=120)
    assert status == 400, out
    assert out["error"]["param"] == "sampling_params.stop_regex", out
    server.wait_idle()


def test_plain_stop_regex_still_stops(server):
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "regex": "ab{30}",
          "stop_regex": "b{3}"}  # fmt: skip
    status, out = server.post("/generate", {"text": "x", "sampling_params": sp})
    assert status == 200, out
    assert out["text"] == "a" and out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("pattern", ["(?:hello world){e<=10}", "(ab){i<=1,d<=1}x", "(a){e}"])
def test_fuzzy_stop_regex_is_refused(server, pattern):
    status, out = server.post("/v1/completions", {"prompt": "x", "stop_regex": pattern})
    assert status == 400 and out["error"]["param"] == "stop_regex", out
    status, out = server.post(
        "/generate", {"text": "x", "sampling_params": {"stop_regex": pattern}}
    )
    assert status == 400 and out["error"]["param"] == "sampling_params.stop_regex", out


def test_sigterm_ends_the_server_during_an_attack(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir)
    try:
        srv.wait_ready()
        body = {"messages": USER, "tools": many_tools(200_000), "max_tokens": 1}
        attack = threading.Thread(target=lambda: _quietly(srv.post, CHAT, body, 120))
        attack.start()
        time.sleep(1.0)  # the body is arriving or being decoded
        srv.proc.terminate()
        srv.proc.wait(30)  # raises TimeoutExpired when SIGTERM is ignored
        attack.join(120)
    finally:
        srv.stop()


def _quietly(call, *args) -> None:
    with contextlib.suppress(OSError):
        call(*args)


def test_tokenize_with_empty_messages_is_400(server):
    status, out = server.post("/tokenize", {"messages": [], "tools": []})
    assert status == 400 and out["error"]["param"] == "messages", out
