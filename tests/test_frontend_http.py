"""RuntimeEndpoint against a real `radixrt serve` subprocess on the tiny model: the same
programs give the same greedy results as the in-process backend, and hold their contexts
while they run (run_batch's admission included) as they do in-process."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from server_utils import serving
from test_frontend_admission import chain

from radixrt import SamplingParams
from radixrt.frontend import (
    BackendError,
    EngineBackend,
    RuntimeEndpoint,
    assistant,
    function,
    gen,
    select,
    system,
    tool_result,
    tools,
    user,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT_S = 90
GREEDY = {"temperature": 0, "max_tokens": 4}
SHARED = "You are a careful assistant. Think about the question, then answer it briefly. " * 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "serve.log"
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "radixrt.cli", "serve", "--model", tiny_model_dir]
    cmd += ["--device", "cpu", "--dtype", "float32", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()}"
                )
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:  # refused / not ready (HTTPError 503 is an OSError too)
        return False


@pytest.fixture(scope="module")
def endpoint(server_url, tiny_model_dir):
    return RuntimeEndpoint(server_url, model_path=tiny_model_dir)


@pytest.fixture
def local(make_engine):
    b = EngineBackend(make_engine())
    yield b
    b.close()


@function
def everything(s, question, forks_out=None):
    s += system("Be brief.")
    s += user(question)
    s += assistant(gen("answer", stop="\n"))
    with s.user():
        s += "Sure? " + SHARED
    with s.assistant():
        s += "Verdict:" + select("verdict", choices=[" yes", " no", " not sure"])
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" Reason {i}:" + gen("reason", ignore_eos=True)
        forks.join()
        s += " Reasons:" + "|".join(forks["reason"])
        s += gen("final", max_tokens=3)
    if forks_out is not None:
        forks_out += forks


def test_same_program_same_results_on_both_backends(endpoint, local):
    # both hold back requests sharing an uncached prefix: a fork sends its prefix hint
    # without waiting for it
    assert endpoint.holds_back_shared_prefixes and local.holds_back_shared_prefixes
    forks = []
    remote = everything.run("What is 2+2?", forks, backend=endpoint, gen_defaults=GREEDY)
    here = everything.run("What is 2+2?", backend=local, gen_defaults=GREEDY)
    assert remote.text() == here.text()
    assert remote.variables() == here.variables()
    assert remote.messages() == here.messages()
    remote_scores = remote.meta("verdict")["scores"]
    assert remote_scores == pytest.approx(here.meta("verdict")["scores"], abs=1e-4)
    for key in ("prompt_tokens", "completion_tokens", "finish_reason", "output_ids"):
        assert remote.meta("answer")[key] == here.meta("answer")[key]
    # the prefix was computed once: by the fork's hint, which the branches waited for on the
    # server, or by the one branch that reached the server before it
    n_shared = len(endpoint.encode(forks[0].text().rsplit(" Reason", 1)[0]))
    cached = sorted(f.meta("reason")["cached_tokens"] for f in forks)
    assert all(n >= n_shared - 1 for n in cached[1:])


def test_the_server_reports_how_it_schedules(endpoint):
    """GET /get_server_info carries the scheduler's resolved policy and prefix cache, from
    which the endpoint reads that the server holds back requests sharing a prefix."""
    info = endpoint._request("GET", "/get_server_info")
    assert (info["schedule_policy"], info["prefix_cache"]) == ("lpm", "radix")
    assert info["disable_radix_cache"] is False and endpoint.holds_back_shared_prefixes


def test_run_batch_and_streaming_over_http(endpoint, local):
    batch = [{"question": f"What is {i}+{i}?"} for i in range(2)]
    remote = everything.run_batch(batch, backend=endpoint, gen_defaults=GREEDY)
    here = everything.run_batch(batch, backend=local, gen_defaults=GREEDY)
    assert [s.text() for s in remote] == [s.text() for s in here]
    stream = everything.run("What is 0+0?", backend=endpoint, stream=True, gen_defaults=GREEDY)
    chunks = list(stream.text_iter())
    assert len(chunks) > 10 and "".join(chunks) == stream.text() == here[0].text()


def test_example_runs_against_the_server(server_url, capsys):
    from radixrt.frontend.examples import few_shot_select

    states = few_shot_select.main(["--url", server_url, "--num-questions", "2"])
    assert [s["answer"] for s in states] and "accuracy" in capsys.readouterr().out


def test_tokenizer_path_from_the_server(server_url, tiny_model_dir):
    endpoint = RuntimeEndpoint(server_url)  # no model_path: the server reports its model dir
    assert os.path.samefile(endpoint.model_path, tiny_model_dir)


def test_server_rejects_bad_input_with_value_error(endpoint, local):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="server rejected the request: .*vocabulary"):
        endpoint.generate([10**6], params)
    with pytest.raises(ValueError, match="vocabulary"):
        local.generate([10**6], params)


def test_unreachable_server_raises_backend_error(tiny_model_dir):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(BackendError, match=f"cannot reach the radixrt server at {url}"):
        RuntimeEndpoint(url, model_path=tiny_model_dir)


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"}},
    "required": ["city"],
    "additionalProperties": False,
}


@function
def one_call(s):
    s += tools([{"name": "weather", "parameters": CITY}])
    s += user("Weather in Oslo?")
    s += assistant(
        gen(
            "step", max_tokens=120, tool_choice="required", parallel_tool_calls=False, temperature=0
        )
    )
    for call in s.tool_calls("step"):
        s += tool_result(call["id"], "rain")
    s += assistant(gen("answer", max_tokens=4, temperature=0))


def test_tool_calls_over_http_equal_in_process(endpoint, local):
    """/generate's structural_tag carries the DSL's constraint: the same calls and text."""
    remote, here = one_call.run(backend=endpoint), one_call.run(backend=local)
    assert remote.text() == here.text()
    calls = remote.tool_calls("step")
    assert [c["name"] for c in calls] == ["weather"] and set(calls[0]["arguments"]) == {"city"}
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["name"], c["arguments"]) for c in here.tool_calls("step")
    ]


@function
def agent(s, endpoint, seen):
    s += "An agent step:" + gen("a", max_tokens=3, temperature=0)
    s += " tool output." + gen("b", max_tokens=3, temperature=0)
    s["b"]  # noqa: B018 (waits for the gen)
    seen.append(endpoint.cache_pressure())  # read while the program runs


def test_a_program_over_http_holds_its_context_and_releases_it(endpoint):
    """A radixrt server gives a program the holds it gets in-process: its context is held
    between its calls (under the ids /generate returned) and released at its end."""
    assert endpoint.releases_holds
    seen = []
    agent.run(endpoint, seen, backend=endpoint)
    during, after = seen[0], endpoint.cache_pressure()
    assert during.held_blocks > 0 and during.held and during.block_size == 16
    assert after.held == frozenset() and after.held_blocks == 0


def test_run_batch_admission_over_http(tiny_model_dir, batch_admissions):
    """8 chains whose contexts need twice the held share (as the in-process admission test):
    over HTTP some wait for the held ones to end, outputs equal a run without admission, no
    hold is left and the pool's integrity holds."""
    gates = batch_admissions
    args = ("--num-kv-blocks", "96", "--block-size", "16", "--retention-max-share", "0.5")
    with serving(tiny_model_dir, *args) as srv:
        endpoint = RuntimeEndpoint(srv.url, model_path=tiny_model_dir)
        batch = [{"i": i} for i in range(8)]
        states = chain.run_batch(batch, backend=endpoint)
        assert gates and gates[0].waits > 0
        assert not gates[0]._reserved and not gates[0]._waiters
        pressure = endpoint.cache_pressure()
        assert pressure.held == frozenset() and pressure.held_blocks == 0
        off = chain.run_batch(batch, backend=endpoint, admission=False)
        assert [s.text() for s in states] == [s.text() for s in off]
        assert len(gates) == 1
        srv.wait_idle()  # nothing runs or holds KV, integrity holds
        assert "integrity check failed" not in srv.output(None)


class _OlderServer(http.server.BaseHTTPRequestHandler):
    """A server without the hold routes: /health answers, everything else is a 404."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        ok = self.path == "/health"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}' if ok else b'{"error": "not found"}')

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


def test_a_server_without_hold_routes_keeps_holds_off(tiny_model_dir):
    """GET /cache_pressure answers 404 (an older radixrt, SGLang): explicit hints only, no
    release, no admission data."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OlderServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        endpoint = RuntimeEndpoint(url, model_path=tiny_model_dir)
        assert not endpoint.releases_holds and endpoint.cache_pressure() is None
        assert not endpoint.holds_back_shared_prefixes  # no GET /get_server_info either
        endpoint.release_cache_holds(["x"])  # sends nothing
    finally:
        httpd.shutdown()
        httpd.server_close()


class _PressureServer(http.server.BaseHTTPRequestHandler):
    """/health, a slow GET /cache_pressure that counts its calls, /generate (one token) and
    /release_cache_holds; 404 elsewhere."""

    reads = 0
    lock = threading.Lock()

    def _json(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/health":
            self._json(b'{"status": "ok"}')
        elif self.path == "/cache_pressure":
            with _PressureServer.lock:
                _PressureServer.reads += 1
            time.sleep(0.05)  # every caller that comes meanwhile shares this reading
            self._json(
                b'{"num_blocks": 64, "block_size": 16, "free_blocks": 64, "evictable_blocks": 0,'
                b' "held_blocks": 0, "max_held_blocks": 32, "holds_refused": 0, "held": []}'
            )
        else:
            self._json(b'{"error": "not found"}', 404)

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/generate":
            self._json(
                b'{"text": "x", "output_ids": [5], "meta_info": {"id": "r1", '
                b'"finish_reason": {"type": "length"}, "prompt_tokens": 3, '
                b'"completion_tokens": 1, "cached_tokens": 0}}'
            )
        elif self.path == "/release_cache_holds":
            self._json(b'{"released": 1}')
        else:
            self._json(b'{"error": "not found"}', 404)

    def log_message(self, *args):
        pass


def test_cache_pressure_reads_are_shared_but_never_older_than_a_result(tiny_model_dir):
    """Threads that ask together share one GET /cache_pressure; a result that came back (or
    a release) after a reading was asked for makes the next caller read again, so a caller
    sees its own request's hold."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PressureServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = RuntimeEndpoint(f"http://127.0.0.1:{httpd.server_address[1]}", tiny_model_dir)
        assert endpoint.releases_holds
        _PressureServer.reads = 0
        readers = [threading.Thread(target=endpoint.cache_pressure) for _ in range(8)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        assert _PressureServer.reads < 8  # shared while one GET was in flight
        shared = _PressureServer.reads
        endpoint.generate([1, 2, 3], SamplingParams(max_tokens=1))
        endpoint.cache_pressure()
        assert _PressureServer.reads == shared + 1  # asked for before the result: read again
        endpoint.release_cache_holds(["r1"])
        endpoint.cache_pressure()
        assert _PressureServer.reads == shared + 2
    finally:
        httpd.shutdown()
        httpd.server_close()
