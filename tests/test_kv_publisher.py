"""The KV event publisher end to end over ZMQ, decoded as vLLM's consumers decode it (msgspec
structs declared here from vLLM v0.11.0's schema): sequenced batches on the PUB socket, a
replay from a sequence number on the ROUTER socket; and `radixrt serve
--kv-events-endpoint` publishing the events of real requests."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from server_utils import ServerProcess, free_port
from test_kv_events import ref_hashes

from radixrt.cache.kv_events import BlockRemoved, BlockStored
from radixrt.server.kv_publisher import KVEventsConfig, ZmqEventPublisher, kv_event_sources

RECV_TIMEOUT_MS = 10_000
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


# ---- the consumer's side: vLLM's structs, as its subscribers declare them ----
class VStored(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag="AllBlocksCleared"):
    pass


class VBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VStored | VRemoved | VCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(VBatch)


def subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.connect(endpoint)
    return sub


def wait_subscribed(pub: ZmqEventPublisher, sub: zmq.Socket) -> int:
    """Publish probe batches until the subscriber gets one (PUB drops messages sent before a
    subscription is in place); returns the next sequence number."""
    sub.setsockopt(zmq.RCVTIMEO, 100)
    while True:
        pub.publish([])
        try:
            _, seq, _ = sub.recv_multipart()
            break
        except zmq.Again:
            continue
    sub.setsockopt(zmq.RCVTIMEO, 200)
    last = int.from_bytes(seq, "big")
    while True:  # drain the probes still in flight
        try:
            last = int.from_bytes(sub.recv_multipart()[1], "big")
        except zmq.Again:
            break
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    return last + 1


def test_publisher_sequences_and_replays():
    ctx = zmq.Context()
    port, replay_port = free_port(), free_port()
    cfg = KVEventsConfig(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic="kv", token_ids=True
    )
    pub = ZmqEventPublisher(cfg, ctx)
    sub = subscriber(ctx, cfg.endpoint)
    try:
        first = wait_subscribed(pub, sub)
        for i in range(5):
            pub.publish([BlockStored([i, i + 100], None, [1] * 8, 4, None, "GPU")])
        pub.publish([BlockRemoved([0], "GPU")])
        got = []
        for _ in range(6):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        assert [s for s, _ in got] == list(range(first, first + 6))
        assert got[0][1].events == [VStored([0, 100], None, [1] * 8, 4, None, "GPU")]
        assert got[5][1].events == [VRemoved([0], "GPU")] and got[5][1].data_parallel_rank == 0
        # a subscriber that missed the last three asks for them again
        # (a DEALER: one request, a stream of replies, as vLLM's ROUTER sends them)
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        req.connect(cfg.replay_endpoint)
        req.send_multipart((b"", (first + 3).to_bytes(8, "big")))
        replayed = []
        while True:
            empty, seq, payload = req.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        assert replayed == got[3:]
        req.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.shutdown()
        ctx.term()


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[int]:
    """Sequence numbers a replay from `start` returns."""
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    req.connect(endpoint)
    req.send_multipart((b"", start.to_bytes(8, "big")))
    seqs = []
    while True:
        _, seq, _ = req.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            req.close(linger=0)
            return seqs
        seqs.append(int.from_bytes(seq, "big"))


def test_replay_buffer_is_bounded():
    ctx = zmq.Context()
    cfg = KVEventsConfig("inproc://kv-pub", "inproc://kv-replay", buffer_steps=3)
    pub = ZmqEventPublisher(cfg, ctx)
    try:
        for i in range(7):
            pub.publish([BlockRemoved([i], "GPU")])
        seqs = []
        for _ in range(1000):  # until the sender thread has sent all seven
            seqs = replay(ctx, cfg.replay_endpoint, 0)
            if seqs and seqs[-1] == 6:
                break
        assert seqs == [4, 5, 6]
        assert replay(ctx, cfg.replay_endpoint, 6) == [6]
        assert replay(ctx, cfg.replay_endpoint, 7) == []
    finally:
        pub.shutdown()
        ctx.term()


def test_sources_and_config():
    assert kv_event_sources(None, 16) == []
    cfg = KVEventsConfig("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    [src] = kv_event_sources(cfg, 16)
    assert src["endpoint"] == cfg.endpoint and src["replay_endpoint"] == cfg.replay_endpoint
    assert src["block_size"] == 16
    with pytest.raises(ValueError, match="tcp://"):
        KVEventsConfig("127.0.0.1:5557")
    # ZMQ has no authentication: loopback only, unless the operator allows others
    for addr in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.0.0.1:5557", "tcp://eth0:1"):
        with pytest.raises(ValueError, match="not a loopback address"):
            KVEventsConfig(addr)
        with pytest.raises(ValueError, match="not a loopback address"):
            KVEventsConfig("tcp://127.0.0.1:5557", addr)
        assert KVEventsConfig(addr, allow_remote=True).endpoint == addr
    for addr in ("tcp://[::1]:5557", "tcp://localhost:5557", "tcp://127.0.0.2:1", "ipc:///tmp/k"):
        assert KVEventsConfig(addr).endpoint == addr


def test_events_carry_hashes_unless_token_ids_are_asked_for():
    """A tenant's prompt is in its blocks' token ids: the default publishes hashes only, and
    a server with tenants refuses to publish token ids."""
    from radixrt.server.launch import ServeConfig
    from radixrt.server.tenants import Tenants

    ctx = zmq.Context()
    try:
        for token_ids, expected in ((False, []), (True, [7] * 4)):
            cfg = KVEventsConfig(f"inproc://kv-{token_ids}", token_ids=token_ids)
            pub = ZmqEventPublisher(cfg, ctx)
            sub = subscriber(ctx, cfg.endpoint)
            wait_subscribed(pub, sub)
            pub.publish([BlockStored([5], None, [7] * 4, 4, None, "GPU")])
            [event] = DECODER.decode(sub.recv_multipart()[2]).events
            assert (event.block_hashes, event.token_ids) == ([5], expected)
            sub.close(linger=0)
            pub.shutdown()
    finally:
        ctx.term()
    tenants = Tenants({"k" * 16: "a"})
    with pytest.raises(ValueError, match="every tenant's prompts"):
        ServeConfig("m", tenants=tenants, kv_events=KVEventsConfig("ipc:///x", token_ids=True))
    assert ServeConfig("m", tenants=tenants, kv_events=KVEventsConfig("ipc:///x")).tenants


def test_serve_publishes_kv_events(tiny_model_dir):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    srv = ServerProcess(
        tiny_model_dir,
        "--kv-events-endpoint", endpoint, "--kv-events-hash-seed", "0", "--block-size", "4",
        "--kv-events-token-ids",
    )  # fmt: skip
    ctx = zmq.Context()
    sub = subscriber(ctx, endpoint)
    try:
        srv.wait_ready()
        seqs: list[int] = []

        def receive(timeout_ms: int) -> list:
            sub.setsockopt(zmq.RCVTIMEO, timeout_ms)
            events = []
            try:
                while True:
                    _, seq, payload = sub.recv_multipart()
                    seqs.append(int.from_bytes(seq, "big"))
                    events += DECODER.decode(payload).events
            except zmq.Again:
                return events

        for i in range(20):  # until the subscription is in place (PUB drops what precedes it)
            body = {"text": f"{i} warm up " * 4, "sampling_params": {"max_new_tokens": 2}}
            assert srv.post("/generate", body)[0] == 200
            if receive(1000):
                break
        receive(500)
        body = {"text": "the quick brown fox jumps over the lazy dog", "sampling_params": GREEDY}
        assert srv.post("/generate", body)[0] == 200
        events = receive(2000)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        stored = [e for e in events if isinstance(e, VStored)]
        assert stored and all(e.medium == "GPU" and e.block_size == 4 for e in stored)
        # the chain from block 0, recomputed from its token ids as a router would
        hashes, tokens, parent = [], [], None
        by_parent = {e.parent_block_hash: e for e in stored}
        while parent in by_parent:
            e = by_parent.pop(parent)
            hashes += e.block_hashes
            tokens += e.token_ids
            parent = e.block_hashes[-1]
        assert len(hashes) >= 3 and hashes == ref_hashes(tokens, 4, "0")
    finally:
        sub.close(linger=0)
        ctx.term()
        srv.stop()
