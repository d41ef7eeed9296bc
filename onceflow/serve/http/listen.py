"""Serving the HTTP app on a TCP listener with hypercorn's Trio protocol server, within a connection cap.
Trio thread: the server's own Trio run (no worker process, no thread).
"""

from __future__ import annotations

import contextlib
import errno
import math
import time
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext

from onceflow.observability.logs import get_logger
from onceflow.serve.http.app import Gate
from onceflow.serve.http.options import HttpOptions
from onceflow.serve.http.protocol import FastH11Protocol

log = get_logger("onceflow.serve.http")

BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)
BUSY_BODY = (
    b'{"type":"reply","command":"unknown","ok":false,"result":null,"error":{"code":"busy","message":'
    b'"the server serves its maximum of HTTP connections","field":null,"retryable":true},"events":[]}'
)
ACCEPT_RETRY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _Config(Config):
    """Hypercorn's config, its response headers (the Date header) made once a second, not per response."""

    _made: tuple[tuple[int, str], list[tuple[bytes, bytes]]] = ((-1, ""), [])

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        key = (int(time.time()), protocol)
        if self._made[0] != key:
            self._made = (key, super().response_headers(protocol))
        return list(self._made[1])  # a copy: a caller may add to it


def hypercorn_config(options: HttpOptions, grace: float) -> Config:
    """Hypercorn's bounds from ours: header bytes, keep-alive and read timeouts, the drain time; no access
    log (the runtime logs what it does), no h2c upgrade beyond hypercorn's own limits."""
    config = _Config()
    config.h11_max_incomplete_size = options.max_header
    config.h2_max_header_list_size = options.max_header
    config.keep_alive_timeout = options.keep_alive
    config.read_timeout = int(max(1, options.read_timeout))
    config.graceful_timeout = grace
    config.accesslog = None
    config.errorlog = None
    config.include_server_header = False
    return config


class _IdleTimer:
    """Hypercorn's keep-alive timer without a task started per request (its own starts one each time the
    connection goes idle and cancels it at the next request): one watcher task per connection, whose
    deadline is `keep_alive` seconds ahead while the connection is idle and infinite while a request is
    under way. Past the deadline, or when the server stops while the connection is idle, it closes the
    connection (as hypercorn's `_idle_timeout` does); `close` ends it when the connection has ended."""

    def __init__(self, server: _TCPServer) -> None:
        self._server = server
        self._scope = trio.CancelScope()
        self._started = self._idle = self._closed = False

    async def restart(self, task_group: Any, _: Any) -> None:
        """The connection is idle (hypercorn's `Updated(idle=True)`, and once at its start)."""
        self._idle = True
        self._scope.deadline = trio.current_time() + self._server.config.keep_alive_timeout
        if not self._started:
            self._started = True
            task_group.spawn(self._watch)

    async def stop(self) -> None:
        """A request is under way: no deadline until it is answered."""
        self._idle = False
        self._scope.deadline = math.inf

    def close(self) -> None:
        """The connection has ended: the watcher ends without closing anything."""
        self._closed = True
        self._scope.cancel()

    async def _watch(self) -> None:
        with self._scope:
            await self._server.context.terminated.wait()
            if not self._idle:  # hypercorn closes the connection after the response under way
                await trio.sleep_forever()
        if not self._closed:
            with trio.CancelScope(shield=True):
                await self._server._initiate_server_close()


class _TCPServer(TCPServer):
    """Hypercorn's connection server, ending as soon as its client has gone (its own keeps the
    connection's task group, so its slot, open until the keep-alive timer runs out), with a keep-alive
    timer that starts no task per request (`_IdleTimer`), no write of the empty end of a sized body, no
    checkpoint taking a free write lock, and HTTP/1.1 spoken by `FastH11Protocol` (commands answered by
    `gate` without an ASGI request; `gate` None, as behind CORS: every request through the app)."""

    def __init__(
        self, app: Any, config: Config, context: WorkerContext, stream: Any, gate: Gate | None
    ) -> None:
        super().__init__(app, config, context, {}, stream)
        self.idle_task = _IdleTimer(self)  # type: ignore[assignment]
        self._gate = gate

    @property
    def protocol(self) -> ProtocolWrapper:
        return self._wrapper

    @protocol.setter
    def protocol(self, wrapper: ProtocolWrapper) -> None:
        if type(wrapper.protocol) is H11Protocol:  # h2 stays hypercorn's
            wrapper.protocol.__class__ = FastH11Protocol
            wrapper.protocol.gate = self._gate  # type: ignore[attr-defined]
        self._wrapper = wrapper

    async def protocol_send(self, event: Event) -> None:
        if type(event) is not RawData:
            await super().protocol_send(event)
        elif not event.data:
            return  # h11's end of a body of known length: nothing to write, no lock, no checkpoint
        elif self.send_lock.locked():
            await super().protocol_send(event)  # a write under way: wait for it (hypercorn's way)
        else:  # hypercorn's write, taking the free lock without its extra checkpoint (send_all has one)
            self.send_lock.acquire_nowait()
            try:
                with trio.CancelScope(shield=True):
                    await self.stream.send_all(event.data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
            finally:
                self.send_lock.release()

    async def _read_data(self) -> None:
        await super()._read_data()
        self.idle_task.close()  # type: ignore[attr-defined]


class HttpListener:
    """Accepts HTTP clients up to `cap` connections at once; past it a new client gets one `503 busy`
    response and is closed (a kept-alive idle connection times out within `keep_alive` seconds, freeing its
    slot). `stop` stops accepting and asks open connections to close after their current response; `run`
    returns once they did, or `grace` seconds later (then they are cut)."""

    def __init__(self, app: Any, options: HttpOptions, cap: int, grace: float) -> None:
        self._app = ASGIWrapper(app)
        self._gate = app if isinstance(app, Gate) else None  # behind CORS: every request goes through it
        self._config = hypercorn_config(options, grace)
        self._context = WorkerContext(None)
        self._cap, self._grace = cap, grace
        self._open = 0
        self._accepting = trio.CancelScope()
        self.address: tuple[str, int] | None = None

    @property
    def connections(self) -> int:
        """HTTP connections open now."""
        return self._open

    async def run(
        self, listener: trio.SocketListener, *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve `listener` until `stop`, then drain (at most `grace` seconds)."""
        async with trio.open_nursery() as connections:
            task_status.started()
            with self._accepting:
                while True:
                    try:
                        stream = await listener.accept()
                    except OSError as exc:
                        if exc.errno not in ACCEPT_RETRY:
                            raise
                        log.warning("http_accept_paused", errno=errno.errorcode.get(exc.errno or 0))
                        await trio.sleep(0.1)
                        continue
                    if self._open >= self._cap:
                        connections.start_soon(self._refuse, stream)
                    else:
                        self._open += 1
                        connections.start_soon(self._serve, stream)
            await listener.aclose()
            await self._context.terminated.set()  # kept-alive connections close after their response
            connections.cancel_scope.deadline = trio.current_time() + self._grace

    def stop(self) -> None:
        """Stop accepting; open connections finish their current request and close."""
        self._accepting.cancel()

    async def _serve(self, stream: trio.SocketStream) -> None:
        try:
            await _TCPServer(self._app, self._config, self._context, stream, self._gate)
        finally:
            self._open -= 1

    async def _refuse(self, stream: trio.SocketStream) -> None:
        log.warning("http_connections_at_cap", connections=self._open, cap=self._cap)
        with trio.move_on_after(1.0):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all(BUSY_RESPONSE % (len(BUSY_BODY), BUSY_BODY))
        await trio.aclose_forcefully(stream)


async def open_listener(options: HttpOptions, backlog: int) -> trio.SocketListener:
    """A TCP listener on `options.host`:`options.port` (port 0: a free one). Raises OSError if it cannot
    be bound."""
    listeners = await trio.open_tcp_listeners(options.port, host=options.host, backlog=backlog)
    for extra in listeners[1:]:
        await extra.aclose()
    return listeners[0]
