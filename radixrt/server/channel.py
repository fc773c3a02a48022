"""One end of a ZeroMQ PUSH/PULL pipe that carries typed messages.

Both directions between the front and the scheduler use this class; what differs is the
codec (the message union it decodes) and whether this end pushes or pulls, binds or
connects.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")

LINGER_MS = 500  # how long close() may wait to flush unsent messages


class MsgpackCodec(Generic[T]):
    """msgpack bytes <-> messages of one (tagged union) type."""

    def __init__(self, message_type: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def encode(self, msg: T) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes) -> T:
        return self._decoder.decode(data)


class Channel(Generic[T]):
    """A PUSH (send-only) or PULL (receive-only) socket at `addr` (e.g. ipc:///tmp/x/in).

    The binding end must exist before the connecting end sends. `send` never blocks; a
    PULL end offers blocking `recv(timeout_s)`, non-blocking `drain()`, and `recv_async()`
    for asyncio code (do not mix the sync and async receive calls concurrently).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        addr: str,
        codec: MsgpackCodec[T],
        *,
        push: bool,
        bind: bool,
    ) -> None:
        self.addr = addr
        self.codec = codec
        self.push = push
        self.sock = ctx.socket(zmq.PUSH if push else zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.setsockopt(zmq.SNDHWM if push else zmq.RCVHWM, 0)  # unbounded queue
        if bind:
            self.sock.bind(addr)
        else:
            self.sock.connect(addr)
        self._async_sock: zmq.asyncio.Socket | None = None

    def send(self, msg: T) -> None:
        """Queue `msg` for the peer. Raises ConnectionError when no peer is connected."""
        self.send_encoded(self.codec.encode(msg))

    def send_encoded(self, data: bytes) -> None:
        """Queue a message already encoded with `codec.encode` (so that an encoding
        error happens before the caller commits to anything). Raises ConnectionError
        when no peer is connected."""
        assert self.push, "send on a PULL channel"
        try:
            self.sock.send(data, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again as e:
            raise ConnectionError(f"no receiver connected to {self.addr}") from e

    def recv(self, timeout_s: float | None = None) -> T | None:
        """Block until a message arrives (or `timeout_s` passes: returns None)."""
        assert not self.push, "recv on a PUSH channel"
        timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return None
        return self.codec.decode(self.sock.recv(copy=False).buffer)

    def drain(self) -> list[T]:
        """Every message already queued, without blocking."""
        assert not self.push, "drain on a PUSH channel"
        out = []
        while True:
            try:
                frame = self.sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            out.append(self.codec.decode(frame.buffer))

    async def recv_async(self) -> T:
        """Await the next message (asyncio; uses a shadow of the same socket)."""
        assert not self.push, "recv on a PUSH channel"
        if self._async_sock is None:
            self._async_sock = zmq.asyncio.Socket.from_socket(self.sock)
        frame = await self._async_sock.recv(copy=False)
        return self.codec.decode(frame.buffer)

    def close(self) -> None:
        self.sock.close()
