"""HTTP connection hygiene of the front: read deadlines, idle keep-alive, a cap on open
connections below the open-file limit, and requests whose client half-closes.

aiohttp bounds an idle connection (`keepalive_timeout`) but not a request that arrives
slowly, nor how many connections are open; and it closes a connection when the client
shuts down its sending side, even after a complete request. Here:

- `GuardedHandler` (aiohttp's RequestHandler) closes a connection whose request head
  (request line and headers) is not complete `header_timeout_s` after its first byte, and
  answers a complete request after the client's half-close (`shutdown(SHUT_WR)`) before
  closing. A client that closed entirely is told apart by a probe: one interim
  `100 Continue` (HTTP/1.1 clients must accept unsolicited 1xx responses) draws a reset from
  a closed socket, which a periodic SO_ERROR check sees; its handler is then cancelled
  (aborting its generation) as for any other disconnect.
- `body_deadline_middleware` reads a request's body within `body_timeout_s` (408 else), and
  refuses one over the size limit (413 naming it) by its Content-Length before reading it.
- `ConnectionGuard` makes the protocol of each accepted connection and counts them; over
  the cap a connection gets a canned 503 and is closed, without parsing anything.
- `raise_fd_limit` raises the soft RLIMIT_NOFILE to the hard limit; `connection_cap` keeps
  `FD_RESERVE` descriptors for everything else the front opens.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from radixrt.server.metrics import ServerMetrics
from radixrt.server.protocol import ApiError

logger = logging.getLogger(__name__)

FD_RESERVE = 128  # descriptors kept for the front's files, sockets, pipes (~30 in use)
REFUSE_LINGER_S = 1.0  # a refused connection is closed after this at the latest
MAX_REFUSING = 64  # refused connections lingering at once; beyond, reset at once
PEER_CHECK_S = 0.25  # how often a half-closed connection's socket is checked for a reset
PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclass(frozen=True)
class ConnectionLimits:
    """The serve options of HTTP connections (seconds, connections)."""

    header_timeout_s: float = 20.0  # a request head: from its first byte to its end
    body_timeout_s: float = 60.0  # a request body: read whole within this
    keep_alive_timeout_s: float = 75.0  # idle between requests (longer than a proxy's 60 s)
    max_connections: int = 4096  # open at once (capped below the open-file limit)

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")

    def handler_kwargs(self) -> dict[str, Any]:
        """aiohttp RequestHandler options (AppRunner passes them on too)."""
        return {
            "keepalive_timeout": self.keep_alive_timeout_s,
            "access_log": None,
            "auto_decompress": False,  # `read_body` decodes bodies itself
        }


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:  # e.g. a hard limit the kernel caps lower
            logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)
    return soft


def connection_cap(limits: ConnectionLimits, nofile: int) -> int:
    """Connections the front accepts at once: `max_connections`, at most the open-file
    limit less `FD_RESERVE`. ValueError when that leaves none."""
    room = nofile - FD_RESERVE
    if room < 1:
        raise ValueError(f"the open-file limit ({nofile}) leaves no room for connections")
    if limits.max_connections > room:
        logger.warning(
            "max connections %d is over what the open-file limit %d allows: %d",
            limits.max_connections, nofile, room,
        )  # fmt: skip
    return min(limits.max_connections, room)


class ConnectionGuard:
    """The protocol factory of the listening socket: a `GuardedHandler` per connection while
    fewer than `cap` are open, a `Refusal` beyond. Runs on the event loop only."""

    def __init__(
        self, server: web.Server, limits: ConnectionLimits, cap: int, metrics: ServerMetrics
    ) -> None:
        self.server = server
        self.limits = limits
        self.cap = cap
        self.metrics = metrics
        self.open = 0  # GuardedHandlers made and not yet closed
        self.refusing = 0  # Refusals not yet closed
        metrics.http_connections.set_function(lambda: self.open)

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.cap:
            self.metrics.http_connections_refused.inc()
            self.refusing += 1
            return Refusal(self)
        self.open += 1
        loop = asyncio.get_running_loop()
        return GuardedHandler(self, self.server, loop=loop, **self.limits.handler_kwargs())


class GuardedHandler(RequestHandler):
    """aiohttp's handler with a request-head deadline and half-close support (see the
    module docstring). Uses the handler's `_waiter`, `_request_count`, `_messages` and
    `_current_request` (as in aiohttp 3.14; tests/test_server_connections checks each
    behaviour over raw sockets)."""

    def __init__(self, guard: ConnectionGuard, server: web.Server, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self.guard = guard
        self.counted = True  # `guard.open` includes this connection
        self.head_timer: asyncio.TimerHandle | None = None
        self.heads_at_timer = 0  # requests parsed when the head timer started
        self.peer_timer: asyncio.TimerHandle | None = None
        self.last_head: Any = None  # the latest request's parsed head and body stream
        self.last_body: Any = None
        self.half_closed = False  # the client's EOF came after a complete request

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:  # a head is complete
            self._cancel(self.head_timer)
            self.head_timer = None
            if self._messages:
                self.last_head, self.last_body = self._messages[-1]
        elif self.head_timer is None and self._between_requests():
            self.heads_at_timer = heads
            self.head_timer = self._loop.call_later(
                self.guard.limits.header_timeout_s, self._on_head_timeout
            )

    def _between_requests(self) -> bool:
        """No request is being handled: bytes arriving now start a request head."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            return True  # the handler loop waits for the next request
        return self._request_count == 0 and self._current_request is None

    def _on_head_timeout(self) -> None:
        self.head_timer = None
        if self._request_count == self.heads_at_timer and self.transport is not None:
            self.guard.metrics.http_timeouts.labels(phase="header").inc()
            logger.info("closing a connection: request head not complete in time")
            self.force_close()

    def eof_received(self) -> bool | None:
        """The client will send nothing more. With a whole request in hand, answer it and
        then close (True keeps the transport open for writing); else close now."""
        if self.half_closed:  # told again (uvloop)
            return True
        waiter = self._waiter
        idle = waiter is not None and not waiter.done()  # every request answered
        if idle or self.last_body is None or not self.last_body.is_eof():
            return None
        self.half_closed = True
        self.close()  # no further requests on this connection
        transport = self.transport
        if transport is not None:
            request = self._current_request
            version = getattr(self.last_head, "version", (1, 0))  # unparsable: no probe
            if version >= (1, 1) and (request is None or request.writer.output_size == 0):
                transport.write(PROBE)
            self.peer_timer = self._loop.call_later(PEER_CHECK_S, self._check_peer)
        return True

    def _check_peer(self) -> None:
        """Half-closed: a reset (the client closed entirely) ends the connection."""
        self.peer_timer = None
        transport = self.transport
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if sock is not None else 0
        if err:
            logger.info("client gone after its half-close (%s)", errno.errorcode.get(err, err))
            transport.abort()
        else:
            self.peer_timer = self._loop.call_later(PEER_CHECK_S, self._check_peer)

    def connection_lost(self, exc: BaseException | None) -> None:
        for timer in (self.head_timer, self.peer_timer):
            self._cancel(timer)
        self.head_timer = self.peer_timer = None
        if self.counted:
            self.counted = False
            self.guard.open -= 1
        super().connection_lost(exc)

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


_REFUSAL_BODY = (
    b'{"error":{"message":"the server has too many open connections; retry shortly",'
    b'"type":"server_error","param":null,"code":null}}'
)
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%s"
    % (len(_REFUSAL_BODY), _REFUSAL_BODY)
)


class Refusal(asyncio.Protocol):
    """A connection over the cap: a canned 503, the write side closed, whatever the client
    sends discarded until it closes (so it reads the 503 rather than a reset), closed after
    `REFUSE_LINGER_S` at the latest."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if self.guard.refusing > MAX_REFUSING:
            transport.abort()
            return
        transport.write(REFUSAL)
        transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSE_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.guard.refusing -= 1


class GuardedSite(web.BaseSite):
    """aiohttp's SockSite, with `guard` as the protocol factory."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, guard: ConnectionGuard):
        super().__init__(runner, backlog=1024)
        self._sock = sock
        self._guard = guard

    @property
    def name(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._guard, sock=self._sock, backlog=1024)


def body_deadline_middleware(timeout_s: float, metrics: ServerMetrics, max_bytes: int) -> Callable:
    """Read every request body whole within `timeout_s` (handlers then get it from
    aiohttp's cache); 408 otherwise. A body over `max_bytes` is a 413 naming the limit: at
    once by its Content-Length (nothing of it is read), or once that much has arrived (a
    chunked one); the app's `client_max_size` must be `max_bytes`."""
    too_large = f"the request body is over the limit of {max_bytes} bytes"

    @web.middleware
    async def body_deadline(request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.body_exists:
            length = request.content_length
            if length is not None and length > max_bytes:
                raise ApiError(f"{too_large} (Content-Length {length})", status=413)
            try:
                await asyncio.wait_for(request.read(), timeout_s)
            except asyncio.TimeoutError:
                metrics.http_timeouts.labels(phase="body").inc()
                raise ApiError(
                    f"the request body did not arrive within {timeout_s:g} s", status=408
                ) from None
            except web.HTTPRequestEntityTooLarge:
                raise ApiError(too_large, status=413) from None
        return await handler(request)

    return body_deadline
