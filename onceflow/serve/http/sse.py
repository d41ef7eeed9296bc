"""`GET /v1/events`: the runtime's events as Server-Sent Events, `id:` = `event_seq`, resuming after
`Last-Event-ID` (or `?after=`) as the socket's `subscribe after` does. Trio thread (an ASGI endpoint).
"""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from typing import Any

import trio

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.observability.logs import get_logger
from onceflow.protocol.codec import encode
from onceflow.protocol.errors import ProtocolError
from onceflow.protocol.event_stream import EventGap, check_after
from onceflow.protocol.events import Reply
from onceflow.serve.http.api import Receive, Scope, Send

log = get_logger("onceflow.serve.http")


BATCH = 256
"""Events taken from the window at a time; each batch is one write."""
RETRY_MS = 2000
"""What the stream tells EventSource to wait before reconnecting."""


def gap_chunk(gap: EventGap) -> bytes:
    """The `gap` event: events between `after` and `next` may be missing (read durable state)."""
    return f"event: gap\ndata: {json.dumps({'after': gap.after, 'next': gap.next})}\n\n".encode()


def start_after(headers: MutableMapping[str, str] | Any, query: MutableMapping[str, str] | Any) -> int | None:
    """Where a stream resumes: the `Last-Event-ID` header (what EventSource sends on reconnecting), else
    `?after=`, else None (from now on). Raises ProtocolError (field `after`) for a value that is not an
    integer from 0 to 2**63-1."""
    text = headers.get("last-event-id") or query.get("after")
    if text is None or text == "":
        return None
    try:
        value: object = int(text)
    except ValueError:
        value = text
    return check_after(value)


class EventsEndpoint:
    """The ASGI endpoint. A stream ends when the client goes away, when the server stops (`stopping`), or
    when a write waits more than `grace` seconds (a client that stopped reading: it reconnects with
    Last-Event-ID and resumes). It holds no events of its own: one that falls more than the runtime's event
    window behind gets a `gap` event where it fell, and goes on from the oldest held. A comment line every
    `heartbeat` seconds keeps idle connections (and proxies) open."""

    def __init__(self, runtime: Runtime, stopping: trio.Event, heartbeat: float, grace: float) -> None:
        self._runtime, self._stopping = runtime, stopping
        self._heartbeat, self._grace = heartbeat, grace

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from starlette.requests import Request

        request = Request(scope)
        try:
            events = self._runtime.events(start_after(request.headers, request.query_params))
        except ProtocolError as exc:
            body = encode(Reply(command="events", ok=False, error=_info(exc))).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 400,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-store"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, receive, nursery.cancel_scope)
            await self._pump(events, send)
            nursery.cancel_scope.cancel()
        try:
            with trio.move_on_after(self._grace):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass

    async def _watch(self, receive: Receive, scope: trio.CancelScope) -> None:
        """End the stream when the client disconnects or the server stops."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stopped, nursery.cancel_scope)
            while (await receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()
        scope.cancel()

    async def _stopped(self, scope: trio.CancelScope) -> None:
        await self._stopping.wait()
        scope.cancel()

    async def _pump(self, events: Any, send: Send) -> None:
        first = f"retry: {RETRY_MS}\n: next_event_seq {events.next_seq}\n\n".encode()
        if events.gap is not None:
            first += gap_chunk(events.gap)
        if not await self._write(send, first):
            return
        while True:
            got = False
            with trio.move_on_after(self._heartbeat):
                got = await events.wait()
                if not got:
                    return  # the runtime closed
            if not got:
                if not await self._write(send, b": keepalive\n\n"):
                    return
                continue
            taken = events.take(BATCH)
            if isinstance(taken, EventGap):
                chunk = gap_chunk(taken)
            else:
                chunk = b"".join(
                    b"id: %d\ndata: %s\n\n" % (item.seq, encode(item.event).encode()) for item in taken
                )
            if chunk and not await self._write(send, chunk):
                return

    async def _write(self, send: Send, chunk: bytes) -> bool:
        """Send a chunk; False when the client is gone or did not take it within `grace` seconds."""
        try:
            with trio.fail_after(self._grace):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except trio.TooSlowError:
            log.warning("events_client_not_reading_closed", grace_seconds=self._grace)
            return False
        except OSError:
            return False
        return True


def _info(exc: ProtocolError) -> Any:
    from onceflow.serve.wire import error_info

    return error_info(exc)
