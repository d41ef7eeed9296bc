"""Hypercorn's HTTP/1.1 protocol with the hot path cut short: `POST /v1/commands[/{type}]` is answered by the
protocol itself (`CommandStream`, the `Gate`'s own checks and command, no ASGI request: no scope, no
per-request channel, no ASGI messages), and a response of known length goes out in one write. Trio thread
(a connection's task group, in the server's Trio run).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import unquote

import h11
from hypercorn.events import RawData
from hypercorn.protocol.events import Body, EndBody, Response, StreamClosed
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import STREAM_ID, H11Protocol
from hypercorn.typing import H11SendableEvent

from onceflow.serve.http.api import Headers, reply_parts
from onceflow.serve.http.app import SECURITY_HEADERS, UNAUTHORIZED, WWW_AUTHENTICATE, Gate, command_path
from onceflow.serve.http.options import Role


class FastH11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol (the listener swaps it in for hypercorn's own, `gate` set): a command
    request is a `CommandStream` instead of an ASGI request (`gate` None: every request is ASGI); a response
    of known length (a `content-length` header) is written with its first body bytes, one write where
    hypercorn makes two (a response without a length, an event stream, has its head written at once)."""

    gate: Gate | None = None
    _held = b""

    async def _create_stream(self, request: h11.Request) -> None:
        path = ""
        if self.gate is not None and request.method == b"POST":
            path = unquote(request.target.partition(b"?")[0].decode("ascii"))  # as hypercorn's scope path
        if self.gate is None or not command_path(path):
            await super()._create_stream(request)
            return
        stream = CommandStream(self.gate, path, list(request.headers), self.stream_send)
        self.stream = stream  # type: ignore[assignment]  # it takes the events an HTTPStream takes
        self.keep_alive_requests += 1
        await self.context.mark_request()
        if stream.refused:
            await stream.answer()

    async def _send_h11_event(self, event: H11SendableEvent) -> None:
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return
        if type(event) is h11.Response and b"\r\ncontent-length:" in data.lower():  # h11 wrote `name: value`
            self._held = data
            return
        if self._held:
            data, self._held = self._held + data, b""
        await self.send(RawData(data=data))


class CommandStream:
    """One `POST /v1/commands[/{type}]` request over HTTP/1.1, as the `Gate` answers it: no known token
    (when the server has tokens) is 401 at once; a body longer than `gate.max_body` (by its Content-Length
    or as it arrives) is 413 at once, the rest unread (the connection then closes); else, once the body has
    arrived, the command's reply (`Gate.command`) in one response. It takes the events hypercorn's
    HTTPStream takes (`handle`) and sends through the protocol's `send` (Response, Body, EndBody,
    StreamClosed: the protocol then recycles or closes the connection). Nothing is sent once the client has
    gone (`StreamClosed`); a command it started runs on (`Commands.send`)."""

    def __init__(
        self,
        gate: Gate,
        path: str,
        headers: Headers,
        send: Callable[[StreamEvent], Awaitable[None]],
    ) -> None:
        self._gate, self._path, self._send = gate, path, send
        self._role: Role | None = gate.role(path, headers)
        self._chunks: list[bytes] = []
        self._size = 0
        self._too_large = any(
            name == b"content-length" and value.isdigit() and int(value) > gate.max_body
            for name, value in headers
        )
        self.refused = self._role is None or self._too_large
        self.closed = False

    async def handle(self, event: StreamEvent) -> None:
        """Take the request's body (`Body`, `EndBody`) or its end (`StreamClosed`). The reply is sent from
        here, in the connection's reading task: HTTP/1.1 reads no next request before this one's answer."""
        if type(event) is StreamClosed:
            self.closed = True
        elif self.closed:
            return
        elif type(event) is Body:
            self._size += len(event.data)
            if self._size > self._gate.max_body:
                self._too_large = True
                await self.answer()
            else:
                self._chunks.append(event.data)
        elif type(event) is EndBody:
            await self.answer()

    async def answer(self) -> None:
        """Run the command (unless refused) and send its reply; nothing when the client has gone. Cancelled
        (the server's grace ran out), it sends nothing; the command runs on in the command nursery."""
        if self._role is None:
            reply, extra = UNAUTHORIZED, [*SECURITY_HEADERS, WWW_AUTHENTICATE]
        else:
            body = None if self._too_large else b"".join(self._chunks)
            self._chunks = []
            reply, extra = await self._gate.command(self._path, self._role, body), SECURITY_HEADERS
        if self.closed:
            return
        status, headers, body = reply_parts(reply, extra)
        await self._send(Response(stream_id=STREAM_ID, headers=headers, status_code=status))
        await self._send(Body(stream_id=STREAM_ID, data=body))
        await self._send(EndBody(stream_id=STREAM_ID))
        await self._send(StreamClosed(stream_id=STREAM_ID))
