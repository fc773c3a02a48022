"""The KV event publisher of a replica: vLLM's ZMQ wire protocol, so vLLM's event consumers
(vllm-router kv_aware, Dynamo, llm-d) subscribe to radixrt unchanged.

- PUB socket (`endpoint`, bound): one multipart message per batch, `[topic, seq, payload]`:
  `seq` an 8-byte big-endian counter from 0, `payload` a msgpack `KVEventBatch`
  (radixrt.cache.kv_events). The scheduler process publishes one batch per engine step that
  changed the cache.
- ROUTER socket (`replay_endpoint`, bound, optional): a REQ/DEALER client sends
  `[b"", start_seq (8 bytes big-endian)]` and gets `[b"", seq, payload]` for every buffered
  batch with seq >= start_seq, then `[b"", -1 (8 bytes, signed), b""]`. The last
  `buffer_steps` batches are kept.
Encoding and sending run on a thread: `publish` only queues the batch.

ZMQ has no authentication: whoever reaches the sockets reads every tenant's events. So tcp
addresses must be loopback unless the operator allows others (`allow_remote`), and
`BlockStored` carries no token ids (`[]`; the block hashes, salted per tenant, stay) unless the
operator asks for them (`token_ids`), which a server with tenants refuses.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay


@dataclass(frozen=True)
class KVEventsConfig:
    """Where a replica publishes its KV events (`radixrt serve --kv-events-endpoint`)."""

    endpoint: str  # PUB address to bind, e.g. tcp://127.0.0.1:5557
    replay_endpoint: str | None = None  # ROUTER address to bind for replays; None: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    topic: str = ""
    data_parallel_rank: int = 0  # stamped on every batch
    token_ids: bool = False  # BlockStored carries its tokens (else only the hashes)
    allow_remote: bool = False  # tcp addresses other than loopback may be bound

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            addr = getattr(self, name)
            if addr is not None and not addr.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} must be a tcp://, ipc:// or inproc:// address: {addr!r}")
            if addr is not None and not self.allow_remote and not _loopback(addr):
                raise ValueError(
                    f"{name} {addr!r} is not a loopback address: ZMQ has no authentication, so "
                    "anyone who reaches it reads every tenant's cache events; bind 127.0.0.1 "
                    "(or allow remote subscribers explicitly: --kv-events-allow-remote)"
                )
        if self.buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {self.buffer_steps}")
        if self.hwm < 0 or self.data_parallel_rank < 0:
            raise ValueError("hwm and data_parallel_rank must be >= 0")


def _loopback(addr: str) -> bool:
    """ipc/inproc addresses, and tcp ones on a loopback host."""
    if not addr.startswith("tcp://"):
        return True
    host = addr[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface or another host name
        return False


def kv_event_sources(cfg: KVEventsConfig | None, block_size: int) -> list[dict]:
    """The event endpoints of this replica as a router discovers them (the body of
    `/kv_event_sources`): [] when events are off."""
    if cfg is None:
        return []
    return [
        {
            "endpoint": cfg.endpoint,
            "replay_endpoint": cfg.replay_endpoint,
            "topic": cfg.topic,
            "data_parallel_rank": cfg.data_parallel_rank,
            "block_size": block_size,
            "hash_algo": "sha256_cbor",
        }
    ]


class ZmqEventPublisher:
    """Publishes KV event batches on `cfg.endpoint` with replay (see the module docstring).
    `publish` is called from one thread (the scheduler loop); `shutdown` stops the sender."""

    def __init__(self, cfg: KVEventsConfig, ctx: zmq.Context | None = None) -> None:
        from radixrt.cache.kv_events import KVEventBatch, without_token_ids  # scheduler side

        self._batch = KVEventBatch
        self._without_token_ids = without_token_ids
        self.cfg = cfg
        self._ctx = ctx or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._pub.bind(cfg.endpoint)
        self._replay = None
        if cfg.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(cfg.replay_endpoint)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # KVEventBatch, None: stop
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._topic = cfg.topic.encode()
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        """Queue one batch of `events` (radixrt.cache.kv_events), stamped now (their token
        ids left out unless `cfg.token_ids`)."""
        if not self.cfg.token_ids:
            events = self._without_token_ids(events)
        self._queue.put(self._batch(time.time(), events, self.cfg.data_parallel_rank))

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (within `timeout_s`), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            seq = self._next_seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq, payload))
            self._buffer.append((self._next_seq, payload))
            self._next_seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: a replay request of %d frames (3 expected)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
