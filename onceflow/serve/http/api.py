"""`onceflow serve --http`'s commands and resource routes: a request becomes the same command the socket
takes, and its reply is the same `Reply`, with an HTTP status following the error code. Trio thread (the
ASGI app runs in the server's Trio run).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import Response

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.codec import command_type, parse_json
from onceflow.protocol.errors import OnceflowError, ProtocolError
from onceflow.protocol.events import Reply
from onceflow.serve.wire import refusal

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

READ_COMMANDS = frozenset(
    {
        "get_task",
        "list_tasks",
        "list_runs",
        "list_decisions",
        "list_step_entries",
        "task_history",
        "list_review_runs",
        "list_host_calls",
        "get_outcome",
        "list_workflows",
        "get_workflow",
        "list_participants",
        "queue_stats",
        "list_pauses",
        "get_run",
    }
)
"""Commands a `read` token may send: they change nothing."""

SOCKET_ONLY = {
    "subscribe": "events are GET /v1/events (Server-Sent Events)",
    "register_host": "the host role needs a connection of its own: use the Unix socket",
    "host_reply": "the host role needs a connection of its own: use the Unix socket",
}
"""Requests of the socket's that HTTP does not take, and where to go instead."""

STATUS = {
    "invalid_message": 400,
    "workflow_invalid": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "conflict": 409,
    "fence_required": 409,
    "wip_limit": 409,
    "transition_refused": 409,
    "transition_failed": 409,
    "host_refused": 409,
    "paused": 409,
    "too_large": 413,
    "busy": 429,
    "rate_limited": 429,
    "action_failed": 500,
    "action_not_wired": 500,
    "storage_read_only": 500,
    "storage_corrupt": 500,
    "shutting_down": 503,
    "host_unavailable": 503,
    "host_timeout": 504,
}
"""HTTP status per error code; a code not listed is 503 when retryable (retryable storage faults among
them), else 400."""


def status_of(reply: Reply) -> int:
    """The HTTP status of a reply: 200 when ok, else per `STATUS`."""
    if reply.ok or reply.error is None:
        return 200
    found = STATUS.get(reply.error.code)
    if found is not None:
        return found
    return 503 if reply.error.retryable else 400


def reply_json(reply: Reply) -> bytes:
    """`codec.encode(reply)` as UTF-8 bytes, written by pydantic as bytes (no str made and encoded)."""
    return reply.__pydantic_serializer__.to_json(reply)


def reply_response(reply: Reply) -> Response:
    """The reply as the response body (the `Reply` JSON), its status per `status_of`; a retryable refusal
    carries `Retry-After: 1`."""
    status = status_of(reply)
    headers = {"Retry-After": "1"} if reply.error is not None and reply.error.retryable else None
    return Response(reply_json(reply), status_code=status, media_type="application/json", headers=headers)


class UnauthorizedError(OnceflowError):
    """The server asks for a bearer token and the request carried none, or one it does not know."""

    code = "unauthorized"


class ForbiddenError(OnceflowError):
    """A read-only token sent a command that writes."""

    code = "forbidden"


class TooLargeError(OnceflowError):
    """The request body is longer than the server takes (`max_body` bytes)."""

    code = "too_large"


class Commands:
    """Runs commands for HTTP requests. A command runs in the server's command nursery, never cancelled by
    its client going away: what it commits stays committed, its reply is dropped. A `claim_run` runs in the
    request. Over HTTP/1.1 the server reads nothing more of a connection while its command runs, so a client
    gone during a claim's wait is seen only when the reply is written: a run claimed meanwhile is nobody's
    until its lease ends (`run_lease_expired`), then queued again (the socket, which sees a client go at
    once, cancels the claim instead). Long-poll over HTTP with a `wait` short against the lease."""

    def __init__(self, runtime: Runtime, nursery: trio.Nursery) -> None:
        self._runtime = runtime
        self._nursery = nursery

    async def send(self, data: dict[str, Any]) -> Reply:
        """The runtime's reply to `data` (a decoded command object); never raises but Cancelled."""
        if data.get("type") == "claim_run":
            return await self._runtime.send(data)
        done = trio.Event()
        box: list[Reply] = []

        async def run() -> None:
            try:
                box.append(await self._runtime.send(data))
            finally:
                done.set()

        self._nursery.start_soon(run)
        await done.wait()
        return box[0]


async def read_body(receive: Receive, headers: list[tuple[bytes, bytes]], limit: int) -> bytes | None:
    """An ASGI request's body, or None when it is longer than `limit` bytes (read no further than that)."""
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def allowed(role: str, command: str) -> bool:
    """Whether a token of `role` may send `command`."""
    return role == "write" or command in READ_COMMANDS


async def command_reply(
    body: bytes | None, commands: Commands, max_body: int, role: str, path_type: str | None = None
) -> Reply:
    """The reply to `POST /v1/commands` (and `/v1/commands/{type}`, whose path names the type the body may
    omit): `body` is one command object (None: it was longer than `max_body`). Refused before the runtime
    sees it: a body over `max_body` (`too_large`), not JSON or not an object, a socket-only request
    (`invalid_message`, field `type`), a command a read token may not send (`forbidden`), a path type the
    body contradicts (`invalid_message`, field `type`)."""
    command = path_type or "unknown"
    if body is None:
        return refusal(command, TooLargeError(f"request body longer than {max_body} bytes"))
    try:
        data = parse_json(body)
    except ProtocolError as exc:
        return refusal(command, exc)
    if not isinstance(data, dict):
        return refusal(command, ProtocolError("a command must be a JSON object"))
    if path_type is not None and data.setdefault("type", path_type) != path_type:
        return refusal(path_type, ProtocolError(f"type must be {path_type} on this path", field="type"))
    command = command_type(data)
    if command in SOCKET_ONLY:
        return refusal(
            command, ProtocolError(f"{command} is not over HTTP: {SOCKET_ONLY[command]}", field="type")
        )
    if not allowed(role, command):
        return refusal(command, ForbiddenError(f"a read-only token may not send {command}", field="type"))
    return await commands.send(data)


Headers = list[tuple[bytes, bytes]]


def reply_parts(reply: Reply, extra: Headers) -> tuple[int, Headers, bytes]:
    """A reply as a whole response: its status (`status_of`), headers (JSON of its length, `extra`,
    `Retry-After: 1` when retryable) and body (`reply_json`)."""
    body = reply_json(reply)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *extra]
    if reply.error is not None and reply.error.retryable:
        headers.append((b"retry-after", b"1"))
    return status_of(reply), headers, body


async def send_reply(send: Send, reply: Reply, extra: Headers) -> None:
    """Write `reply` as a whole ASGI response (`reply_parts`)."""
    status, headers, body = reply_parts(reply, extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


Query = Mapping[str, str]
Builder = Callable[[Request], dict[str, Any]]


def _number(text: str) -> int | str:
    """A query value as an integer when it is one (so the command's own bound names it), else as is."""
    try:
        return int(text)
    except ValueError:
        return text


def from_query(kind: str, fields: Mapping[str, str], numeric: frozenset[str] = frozenset()) -> Builder:
    """A builder of command `kind` from a request: each query parameter in `fields` to its command field,
    path parameters by their own names; an unknown query parameter is passed on so the command names it."""

    def build(request: Request) -> dict[str, Any]:
        data: dict[str, Any] = {"type": kind, **request.path_params}
        for name, value in request.query_params.items():
            field = fields.get(name, name)
            data[field] = _number(value) if field in numeric else value
        return data

    return build


ROUTES: dict[str, tuple[str, Builder]] = {
    "/v1/tasks": (
        "list_tasks",
        from_query("list_tasks", {"after": "after_task_id"}, frozenset({"limit"})),
    ),
    "/v1/tasks/{task_id}": ("get_task", from_query("get_task", {})),
    "/v1/tasks/{task_id}/history": ("task_history", from_query("task_history", {}, frozenset({"limit"}))),
    "/v1/runs": (
        "list_runs",
        from_query("list_runs", {"after": "after_run_id"}, frozenset({"limit", "after_run_id"})),
    ),
    "/v1/runs/{run_id}": ("get_run", from_query("get_run", {})),
    "/v1/host-calls": (
        "list_host_calls",
        from_query("list_host_calls", {"after": "after_id"}, frozenset({"limit", "after_id"})),
    ),
    "/v1/workflows": ("list_workflows", from_query("list_workflows", {}, frozenset({"limit"}))),
    "/v1/workflows/{workflow_id}": (
        "get_workflow",
        from_query("get_workflow", {}, frozenset({"version"})),
    ),
    "/v1/queue": ("queue_stats", from_query("queue_stats", {})),
    "/v1/pauses": ("list_pauses", from_query("list_pauses", {})),
}
"""The resource routes (GET): path -> (the command it sends, how its fields are read from the request)."""


def get_route(commands: Commands, build: Builder) -> Callable[[Request], Awaitable[Response]]:
    """A GET endpoint sending the command `build` makes of the request."""

    async def endpoint(request: Request) -> Response:
        return reply_response(await commands.send(build(request)))

    return endpoint
