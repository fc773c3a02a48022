"""`radixrt serve --dp 2` (CPU, tiny model): one endpoint (sglang-router, cache_aware) in
front of two replicas on their own loopback ports. Chat, completion and /generate requests
through it succeed and both replicas serve some; a replica killed with SIGKILL is
restarted on its port; SIGTERM to the launcher stops the router and every replica and
leaves none of their processes behind. Skipped without sglang-router."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_utils import free_port, http_call

from radixrt.server import dp
from radixrt.server.dp import offset_endpoint

READY_TIMEOUT_S = 60.0
PROMPT_WORDS = ["apple", "zebra", "mango", "quartz", "violet", "kettle", "banjo", "yonder"]
REPLICA_LINE = re.compile(r"replica (\d+): (http://127\.0\.0\.1:\d+) \(pid (\d+)")

needs_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (pip install 'radixrt[router]')",
)


def test_offset_endpoint():
    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv.1"
    with pytest.raises(ValueError, match="its own KV events address"):
        offset_endpoint("inproc://kv", 1)


def test_missing_router_names_package_and_extra(monkeypatch):
    monkeypatch.setattr(dp.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"sglang-router.*radixrt\[router\]"):
        dp.check_router()


def test_gpu_sets(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7")
    assert dp.gpu_sets("cuda", 2, 1) == ["2", "3"]
    assert dp.gpu_sets("auto", 2, 2) == ["2,3", "5,7"]
    assert dp.gpu_sets("cpu", 2, 1) == [None, None]
    with pytest.raises(ValueError, match="needs 6 GPUs, 4 visible"):
        dp.gpu_sets("cuda", 3, 2)
    # a fixed KV pool per replica (--num-kv-blocks): replicas take the GPU sets in turn
    assert dp.gpu_sets("cuda", 3, 2, share=True) == ["2,3", "5,7", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    assert dp.gpu_sets("cuda", 2, 1, share=True) == ["4", "4"]
    with pytest.raises(ValueError, match="needs 2 GPUs, 1 visible"):
        dp.gpu_sets("cuda", 1, 2, share=True)  # a replica's own TP group still needs its GPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert dp.gpu_sets("auto", 2, 1) == [None, None]


def test_router_command_defaults_then_user_args():
    from radixrt.server.launch import ServeConfig

    cfg = ServeConfig(model="m", host="127.0.0.1", port=8000, api_key="k")
    opts = dp.DPOptions(2, router_args=["--cache-threshold", "0.3"])
    cmd = dp.router_command(cfg, opts, ["http://a", "http://b"], 9001, 9000)
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    # the router listens on loopback only: clients reach it through the front
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "9001"
    # sglang-router's argparse keeps an option's last value: --router-args override ours
    assert cmd.index("--balance-abs-threshold") < cmd.index("--worker-urls")
    thresholds = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--cache-threshold"]
    assert thresholds == ["0.5", "0.3"]
    assert cmd[cmd.index("--balance-abs-threshold") + 1] == "8"
    # loads of busy replicas drift apart by chance: spill only below a quarter of the load
    assert cmd[cmd.index("--balance-rel-threshold") + 1] == "3"
    assert cmd[cmd.index("--worker-urls") + 1 : cmd.index("--api-key")] == ["http://a", "http://b"]


TAKEOVER = [
    ("POST", "/workers", {"url": "http://127.0.0.1:9"}),
    ("DELETE", "/workers/0b7c9e54-5a43-4e2b-8f6c-1f9f3c1d2e3a", None),
    ("GET", "/workers", None),
    ("GET", "/get_loads", None),
]


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait(predicate, what: str, log: Path, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, (
            f"no {what} after {timeout} s:\n{log.read_text()[-4000:]}"
        )
        time.sleep(0.25)


def _generated_tokens(url: str) -> float:
    status, text = http_call(url + "/metrics", None, method="GET", timeout=5)
    assert status == 200, text
    match = re.search(r"^radixrt_generated_tokens_total (\S+)$", text, re.M)
    assert match, text
    return float(match.group(1))


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError):
        return http_call(url + "/health", None, method="GET", timeout=2)[0] == 200
    return False


@needs_router
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_serve_dp_two_replicas(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_file = tempfile.NamedTemporaryFile(prefix="radixrt-dp-", suffix=".log")  # noqa: SIM115
    log = Path(log_file.name)
    env = dict(os.environ)
    cmd = [
        sys.executable, "-m", "radixrt.cli", "serve", "--model", tiny_model_dir, "--dp", "2",
        "--port", str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "info",
        "--router-args", "--balance-abs-threshold 1 --balance-rel-threshold 1.0",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        _wait(lambda: "serving on" in log.read_text(), "'serving on' line", log)
        replicas = {int(i): (u, int(pid)) for i, u, pid in REPLICA_LINE.findall(log.read_text())}
        assert sorted(replicas) == [0, 1], log.read_text()[-4000:]

        def models_listed() -> bool:
            with contextlib.suppress(OSError):
                status, body = http_call(url + "/v1/models", None, method="GET", timeout=5)
                return status == 200 and bool(body.get("data"))
            return False

        _wait(models_listed, "model list from the router", log)
        model = http_call(url + "/v1/models", None, method="GET")[1]["data"][0]["id"]
        # without keys no one manages the router's workers through the endpoint
        for method, path, body in TAKEOVER:
            status, out = http_call(url + path, body, method=method)
            assert status == 403, (path, out)
        # a request without `model` and a batched /generate behave as on one server
        status, out = http_call(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] <= 2, out
        body = {"text": ["one", "two"], "sampling_params": {"max_new_tokens": 2}}
        status, out = http_call(url + "/generate", body)
        assert status == 200 and len(out) == 2, out
        for i, word in enumerate(PROMPT_WORDS):
            text = f"{word} {i * 7919} is a topic worth a long answer"
            status, out = http_call(
                url + "/v1/chat/completions",
                {"messages": [{"role": "user", "content": text}], "max_tokens": 4},
            )
            assert status == 200 and out["choices"][0]["message"]["role"] == "assistant", out
            body = {"model": model, "prompt": text, "max_tokens": 4}
            status, out = http_call(url + "/v1/completions", body)
            assert status == 200 and out["usage"]["completion_tokens"] <= 4, out
            body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            status, out = http_call(url + "/generate", body)
            assert status == 200 and out["meta_info"]["completion_tokens"] <= 4, out

        # sglang-router 0.3.2's cache_aware sends every cache miss to one worker until the
        # loads are imbalanced (the thresholds passed above): requests in flight at once
        # spread over both
        def generate(word: str) -> int:
            body = {"text": f"{word} again", "sampling_params": {"max_new_tokens": 24}}
            return http_call(url + "/generate", body)[0]

        with ThreadPoolExecutor(len(PROMPT_WORDS)) as pool:
            assert set(pool.map(generate, PROMPT_WORDS)) == {200}
        served = [_generated_tokens(replicas[i][0]) for i in (0, 1)]
        assert all(n > 0 for n in served), served

        # a replica killed outright comes back on its port
        replica_url, replica_pid = replicas[0]
        os.killpg(replica_pid, signal.SIGKILL)
        _wait(lambda: "restarting replica 0" in log.read_text(), "restart", log)
        _wait(lambda: _healthy(replica_url), "restarted replica's /health 200", log)
        status, out = http_call(url + "/generate", body)
        assert status == 200, out

        children = _descendants(proc.pid)
        assert len(children) >= 5, children  # router, 2 replicas, their schedulers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-4000:]
        left = sorted(p for p in children if _running(p))
        assert not left, (left, log.read_text()[-4000:])
        assert not _healthy(url) and not _healthy(replica_url)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        log_file.close()


@needs_router
def test_serve_dp_with_keys_resists_takeover(tiny_model_dir, tmp_path):
    """The trial's takeover through `--dp 2` with a keys file: without a key or with a
    tenant's, registering or deleting workers is refused; an admin who deletes both replicas
    from the router sees them registered again, and tenants keep being served by them."""
    admin, alice = "admin-0123456789abcdef", "alice-0123456789abcdef"
    keys = tmp_path / "keys"
    keys.write_text(f"# keys, rotated monthly\n{admin} ops admin\n{alice} alice\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_file = tempfile.NamedTemporaryFile(prefix="radixrt-dp-", suffix=".log")  # noqa: SIM115
    log = Path(log_file.name)
    cmd = [
        sys.executable, "-m", "radixrt.cli", "serve", "--model", tiny_model_dir, "--dp", "2",
        "--port", str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "info",
        "--api-keys-file", str(keys),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)

    def call(path, body=None, key=None, method=None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        method = method or ("GET" if body is None else "POST")
        return http_call(url + path, body, headers, method=method)

    try:
        _wait(lambda: "serving on" in log.read_text(), "'serving on' line", log)
        replica_urls = sorted(u for _, u, _ in REPLICA_LINE.findall(log.read_text()))
        for method, path, body in TAKEOVER:
            assert call(path, body, None, method)[0] == 401, path
            assert call(path, body, alice, method)[0] == 403, path
        status, out = call("/workers", key=admin)
        assert status == 200, out
        assert sorted(w["url"] for w in out["workers"]) == replica_urls
        for w in out["workers"]:
            assert call(f"/workers/{w['id']}", key=admin, method="DELETE")[0] in (200, 202)

        def listed() -> list[str]:
            return sorted(w["url"] for w in call("/workers", key=admin)[1]["workers"])

        _wait(lambda: listed() == replica_urls, "replicas registered again", log, 30)
        assert "missing from the router's workers" in log.read_text()
        for i in range(6):
            body = {"prompt": f"tenant prompt {i}", "max_tokens": 2}  # no `model`
            status, out = call("/v1/completions", body, alice)
            assert status == 200 and out["usage"]["completion_tokens"] <= 2, out
        assert call("/metrics", key=alice)[0] == 403
        assert call("/metrics", key=admin)[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-4000:]
        assert admin not in log.read_text() and alice not in log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        log_file.close()
