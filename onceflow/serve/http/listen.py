"""Serving the HTTP app on a TCP listener with hypercorn's Trio protocol server, within a connection cap.
Trio thread: the server's own Trio run (no worker process, no thread).
"""

from __future__ import annotations

import contextlib
import errno
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext

from onceflow.observability.logs import get_logger
from onceflow.serve.http.options import HttpOptions

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


def hypercorn_config(options: HttpOptions, grace: float) -> Config:
    """Hypercorn's bounds from ours: header bytes, keep-alive and read timeouts, the drain time; no access
    log (the runtime logs what it does), no h2c upgrade beyond hypercorn's own limits."""
    config = Config()
    config.h11_max_incomplete_size = options.max_header
    config.h2_max_header_list_size = options.max_header
    config.keep_alive_timeout = options.keep_alive
    config.read_timeout = int(max(1, options.read_timeout))
    config.graceful_timeout = grace
    config.accesslog = None
    config.errorlog = None
    config.include_server_header = False
    return config


class _TCPServer(TCPServer):
    """Hypercorn's connection server, ending as soon as its client has gone: its own keeps the
    connection's task group (so its slot) open until the keep-alive timer runs out."""

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()


class HttpListener:
    """Accepts HTTP clients up to `cap` connections at once; past it a new client gets one `503 busy`
    response and is closed (a kept-alive idle connection times out within `keep_alive` seconds, freeing its
    slot). `stop` stops accepting and asks open connections to close after their current response; `run`
    returns once they did, or `grace` seconds later (then they are cut)."""

    def __init__(self, app: Any, options: HttpOptions, cap: int, grace: float) -> None:
        self._app = ASGIWrapper(app)
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
            await _TCPServer(self._app, self._config, self._context, {}, stream)  # type: ignore[arg-type]
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
