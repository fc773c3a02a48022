"""`radixrt serve --dp N`: N replicas behind sglang-router (cache_aware) as one endpoint.

Process model: this process (torch-free) starts N replicas, each a `serve()` of its own
(`python -m radixrt.server.dp`, its ServeConfig pickled on stdin) on a free 127.0.0.1
port, in a process group of its own (with its scheduler child), one
per GPU set via CUDA_VISIBLE_DEVICES on CUDA (several per set when there are fewer sets than
replicas and --num-kv-blocks fixes each one's KV pool); it waits until every replica's /health
answers 200, then starts the router on a free 127.0.0.1 port (its Prometheus port on
127.0.0.1 too) in a process group of its own, and serves the authenticating front
(`radixrt.server.dp_front`, a thread here) on --host:--port: clients reach the router and
the replicas only through it. Children get SIGTERM when this process dies
(PR_SET_PDEATHSIG). SIGINT/SIGTERM: the front stops, then the router, then every replica get
SIGTERM; groups still alive after SHUTDOWN_TIMEOUT_S get SIGKILL. A replica that exits, or
whose /health says its scheduler died, is restarted on its port, at most MAX_RESTARTS times,
after a growing backoff; the router's health checks take it out and back in meanwhile. Every
WORKERS_POLL_S the router's worker list is read, and a replica missing from it (removed
through the management API) is registered again.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from radixrt.server.dp_front import FrontThread, Upstreams, create_front_app

if TYPE_CHECKING:
    from radixrt.server.serve_config import ServeConfig

logger = logging.getLogger("radixrt.dp")

ROUTER_MODULE = "sglang_router"
ROUTER_INSTALL = "pip install 'radixrt[router]' (sglang-router==0.3.2)"
ROUTER_POLICY = "cache_aware"
# cache_aware's thresholds (sglang-router 0.3.2 defaults 0.3, 64, 1.5; --router-args override
# them), chosen in RESULTS.md "Data-parallel replicas behind a router": 0.5 so that a shared
# system prompt does not pull every new conversation onto one replica, abs 8 so that one hot
# prefix still spreads, rel 3 so that chance drift between busy replicas does not spill groups.
# No circuit breaker and no retries: a 5xx that one client's request provokes must not take a
# replica out for every client (a dead or stalled replica leaves through health checks and is
# restarted). The router's prefix tree holds a node per prompt character clients send: capped.
ROUTER_MAX_TREE_CHARS = 2**22
ROUTER_DEFAULT_ARGS = (
    "--cache-threshold", "0.5", "--balance-abs-threshold", "8", "--balance-rel-threshold", "3",
    "--disable-circuit-breaker", "--disable-retries",
    "--max-tree-size", str(ROUTER_MAX_TREE_CHARS),
)  # fmt: skip
MAX_RESTARTS = 3  # per replica; then it stays down (the router routes around it)
RESTART_BACKOFF_S = 2.0  # doubled per restart of the same replica
HEALTH_POLL_S = 2.0  # how often a serving replica's /health is read
SHUTDOWN_TIMEOUT_S = 15.0  # after SIGTERM, before SIGKILL of the process groups
WORKERS_POLL_S = 2.0  # how often the router's worker list is checked for our replicas
# the router's log level per ours (its info level logs every step of each worker's registration)
ROUTER_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}


@dataclass(frozen=True)
class DPOptions:
    replicas: int  # N: replica processes behind the router
    router_prometheus_port: int | None = None  # on 127.0.0.1; None: a free one
    router_args: list[str] = field(default_factory=list)  # more launch_router options
    log_level: str = "info"


def check_router() -> None:
    """Raises ValueError naming the package and the extra when the router is missing."""
    if importlib.util.find_spec(ROUTER_MODULE) is None:
        raise ValueError(f"--dp needs sglang-router, which is not installed: {ROUTER_INSTALL}")


def offset_endpoint(endpoint: str, index: int) -> str:
    """Replica `index`'s ZMQ address: tcp://h:p -> tcp://h:(p + index), ipc://path ->
    ipc://path.index (index 0 keeps the address). Raises ValueError for other schemes."""
    if index == 0:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.port is not None:
        host = parts.netloc.rsplit(":", 1)[0]
        return urlunsplit(parts._replace(netloc=f"{host}:{parts.port + index}"))
    if parts.scheme == "ipc":
        return f"{endpoint}.{index}"
    raise ValueError(f"cannot give each replica its own KV events address: {endpoint!r}")


def gpu_sets(device: str, replicas: int, tp_size: int, share: bool = False) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each replica (`tp_size` GPUs each), or None per replica on
    CPU. With fewer GPUs than replicas need: `share` (each replica's KV pool has a fixed
    size, --num-kv-blocks) puts replicas on the GPU sets in turn; otherwise ValueError."""
    if device == "cpu":
        return [None] * replicas
    gpus = _visible_gpus()
    if not gpus and device == "auto":
        return [None] * replicas
    sets = [",".join(gpus[i * tp_size : (i + 1) * tp_size]) for i in range(len(gpus) // tp_size)]
    if len(sets) < replicas and not (share and sets):
        raise ValueError(
            f"--dp {replicas} with {tp_size} GPU(s) per replica needs {replicas * tp_size} "
            f"GPUs, {len(gpus)} visible (replicas share GPUs only with --num-kv-blocks: a "
            "fixed KV pool each)"
        )
    return [sets[i % len(sets)] for i in range(replicas)]


def _visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def replica_configs(cfg: ServeConfig, replicas: int) -> list[ServeConfig]:
    """Each replica's ServeConfig: 127.0.0.1, a free port, its own KV events addresses, and
    on CPU a share of the cores (unless --cpu-threads was given)."""
    threads = cfg.cpu_threads or max(1, (os.cpu_count() or 1) // replicas)
    out = []
    for i in range(replicas):
        kv = cfg.kv_events
        if kv is not None:
            replay = kv.replay_endpoint
            kv = replace(
                kv,
                endpoint=offset_endpoint(kv.endpoint, i),
                replay_endpoint=None if replay is None else offset_endpoint(replay, i),
            )
        out.append(
            replace(cfg, host="127.0.0.1", port=_free_port(), kv_events=kv, cpu_threads=threads)
        )
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: get `sig` when the parent exits (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig, 0, 0, 0)


def _child_setup(parent: int) -> Callable[[], None]:
    """preexec_fn of a child (in its own session): it gets SIGTERM when `parent` dies."""

    def setup() -> None:
        _die_with_parent()
        if os.getppid() != parent:  # the launcher died before prctl
            os._exit(1)

    return setup


class Replica:
    """One replica process (in a process group of its own) and its restart budget."""

    def __init__(self, index: int, cfg: ServeConfig, gpus: str | None, log_level: str) -> None:
        self.index = index
        self.cfg = cfg
        self.gpus = gpus
        self.log_level = log_level
        self.url = f"http://127.0.0.1:{cfg.port}"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.restart_at: float | None = None  # monotonic time of the scheduled restart
        self.next_poll = 0.0

    def start(self) -> None:
        env = dict(os.environ)
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus
        cmd = [sys.executable, "-m", "radixrt.server.replica", str(self.index), self.log_level]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            env=env,
            start_new_session=True,
            preexec_fn=_child_setup(os.getpid()),
        )
        assert self.proc.stdin is not None
        with self.proc.stdin:
            self.proc.stdin.write(pickle.dumps(self.cfg))
        gpus = "" if self.gpus is None else f", CUDA_VISIBLE_DEVICES={self.gpus}"
        logger.info("replica %d: %s (pid %d%s)", self.index, self.url, self.proc.pid, gpus)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout: float) -> None:
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL its process group and reap it."""
        if self.proc is None:
            return
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.wait(5)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def health(url: str, timeout: float = 2.0) -> tuple[int, dict]:
    """(HTTP status, JSON body) of GET url/health; (0, {}) when it cannot be reached."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return 0, {}


def serve_dp(cfg: ServeConfig, opts: DPOptions) -> int:
    """Run N replicas and the router until SIGINT/SIGTERM; returns the exit code (1: a
    replica or the router failed to start, the router died, or every replica is down)."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter("%(asctime)s dp %(levelname)s %(message)s"))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        _check_listen(cfg.host, cfg.port)
        fixed_pool = cfg.options.get("num_kv_blocks") is not None
        gpus = gpu_sets(cfg.device, opts.replicas, _tp_size(cfg), share=fixed_pool)
        configs = replica_configs(cfg, opts.replicas)
        prom_port = opts.router_prometheus_port or _free_port()
        router_port = _free_port()
    except (OSError, ValueError) as e:
        logger.error("cannot serve --dp %d on %s:%d: %s", opts.replicas, cfg.host, cfg.port, e)
        return 1
    replicas = [Replica(i, c, g, opts.log_level) for i, (c, g) in enumerate(zip(configs, gpus))]
    router: subprocess.Popen | None = None
    front: FrontThread | None = None
    router_url = f"http://127.0.0.1:{router_port}"
    try:
        for r in replicas:
            r.start()
        if not _wait_healthy(replicas, stop):
            return 0 if stop.is_set() else 1
        router = _start_router(cfg, opts, [r.url for r in replicas], router_port, prom_port)
        if not _wait_listening("127.0.0.1", router_port, router, stop):
            return 0 if stop.is_set() else 1
        upstreams = Upstreams(
            router_url,
            tuple(r.url for r in replicas),
            f"http://127.0.0.1:{prom_port}/metrics",
            cfg.served_model_name or cfg.model,
        )
        front = FrontThread(
            create_front_app(upstreams, cfg.api_key, cfg.tenants), cfg.host, cfg.port
        )
        try:
            front.start()
        except OSError as e:
            logger.error("cannot serve on %s:%d: %s", cfg.host, cfg.port, e)
            return 1
        logger.info(
            "serving on http://%s:%d: %d replicas behind sglang-router (%s) on %s",
            cfg.host, cfg.port, len(replicas), ROUTER_POLICY, router_url,
        )  # fmt: skip
        return _supervise(replicas, router, router_url, stop)
    finally:
        if front is not None:
            front.stop()
        _shutdown(replicas, router)


def _tp_size(cfg: ServeConfig) -> int:
    return int(cfg.options.get("tensor_parallel_size", 1) or 1)


def _check_listen(host: str, port: int) -> None:
    """Raises OSError when host:port cannot be bound (taken, or no such address)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    socket.create_server((host, port), family=family).close()


def _wait_healthy(replicas: list[Replica], stop: threading.Event) -> bool:
    """Until every replica's /health answers 200: False on stop or when one exits."""
    pending = list(replicas)
    while pending:
        for r in list(pending):
            if not r.alive:
                logger.error(
                    "replica %d exited with code %s while starting", r.index, r.proc.returncode
                )
                return False
            if health(r.url)[0] == 200:
                logger.info("replica %d is ready", r.index)
                pending.remove(r)
        if stop.wait(0.25):
            return False
    return True


def _wait_listening(host: str, port: int, router: subprocess.Popen, stop: threading.Event) -> bool:
    """Until the router accepts connections on host:port: False on stop or its exit."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1" if host != "::" else "::1"
    while True:
        if router.poll() is not None:
            logger.error("the router exited with code %d while starting", router.returncode)
            return False
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return True
        if stop.wait(0.25):
            return False


def router_command(
    cfg: ServeConfig, opts: DPOptions, urls: list[str], port: int, prom_port: int
) -> list[str]:
    """The router's command line (on 127.0.0.1:`port`): our policy and defaults, then
    --router-args (a repeated option's last value wins), then the replicas."""
    cmd = [
        sys.executable, "-m", f"{ROUTER_MODULE}.launch_router",
        "--host", "127.0.0.1", "--port", str(port), "--policy", ROUTER_POLICY,
        *ROUTER_DEFAULT_ARGS,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port),
        "--log-level", ROUTER_LOG_LEVELS[opts.log_level],
        "--shutdown-grace-period-secs", str(int(SHUTDOWN_TIMEOUT_S) // 2),
        *opts.router_args, "--worker-urls", *urls,
    ]  # fmt: skip
    if cfg.api_key is not None:
        cmd += ["--api-key", cfg.api_key]
    return cmd


def _start_router(
    cfg: ServeConfig, opts: DPOptions, urls: list[str], port: int, prom_port: int
) -> subprocess.Popen:
    cmd = router_command(cfg, opts, urls, port, prom_port)
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_child_setup(os.getpid()))
    logger.info("router started (pid %d)", proc.pid)
    return proc


def _supervise(
    replicas: list[Replica], router: subprocess.Popen, router_url: str, stop: threading.Event
) -> int:
    """Watch the router and the replicas until stop; restart dead replicas (bounded) and
    register again those the router's worker list lost."""
    next_workers_poll = time.monotonic() + WORKERS_POLL_S
    while not stop.wait(0.25):
        if router.poll() is not None:
            logger.error("the router exited with code %d", router.returncode)
            return 1
        now = time.monotonic()
        for r in replicas:
            _check_replica(r, now)
        if now >= next_workers_poll:
            next_workers_poll = now + WORKERS_POLL_S
            restore_workers(router_url, [r.url for r in replicas])
        if all(not r.alive and r.restart_at is None for r in replicas):
            logger.error("every replica is down")
            return 1
    logger.info("shutting down")
    return 0


def restore_workers(router_url: str, urls: list[str]) -> list[str]:
    """Register with the router each of `urls` its worker list lacks; returns those."""
    try:
        with urllib.request.urlopen(router_url + "/workers", timeout=5) as resp:
            listed = {w.get("url") for w in json.loads(resp.read()).get("workers", [])}
    except (OSError, ValueError, AttributeError) as e:
        logger.warning("cannot read the router's worker list: %r", e)
        return []
    missing = [u for u in urls if u not in listed]
    for url in missing:
        logger.warning("replica %s is missing from the router's workers: registering it", url)
        req = urllib.request.Request(
            router_url + "/workers",
            data=json.dumps({"url": url}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(req, timeout=5).close()
        except OSError as e:
            logger.warning("cannot register replica %s with the router: %r", url, e)
    return missing


def _check_replica(r: Replica, now: float) -> None:
    if r.restart_at is not None:
        if now >= r.restart_at:
            r.restart_at = None
            r.restarts += 1
            logger.warning(
                "restarting replica %d (restart %d of %d)", r.index, r.restarts, MAX_RESTARTS
            )
            r.start()
        return
    if r.proc is None:
        return
    if r.alive:
        if now < r.next_poll:
            return
        r.next_poll = now + HEALTH_POLL_S
        status, body = health(r.url)
        if status != 503 or body.get("status") != "scheduler_dead":
            return
        logger.error("replica %d: its scheduler died (%s)", r.index, body.get("detail"))
    else:
        logger.error("replica %d exited with code %s", r.index, r.proc.returncode)
    r.kill()
    r.proc = None
    if r.restarts >= MAX_RESTARTS:
        logger.error("replica %d stays down: restarted %d times already", r.index, r.restarts)
        return
    r.restart_at = now + RESTART_BACKOFF_S * 2**r.restarts


def _shutdown(replicas: list[Replica], router: subprocess.Popen | None) -> None:
    """SIGTERM the router, then the replicas; SIGKILL every group left after the timeout."""
    if router is not None and router.poll() is None:
        _signal_group(router.pid, signal.SIGTERM)
        try:
            router.wait(SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the router did not stop in %g s: killing it", SHUTDOWN_TIMEOUT_S)
    if router is not None:
        _signal_group(router.pid, signal.SIGKILL)
        router.wait()
    live = [r for r in replicas if r.proc is not None]
    for r in live:
        if r.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    for r in live:
        r.wait(max(0.0, deadline - time.monotonic()))
    for r in live:  # the group: a scheduler or compile worker left behind
        r.kill()
    logger.info("all replicas stopped")
