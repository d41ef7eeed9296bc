"""`onceflow serve --http`'s ASGI application: bearer-token checks, the command and resource routes, the
event stream, the OpenAPI document and its page, the board and the workflow graphs. Trio thread (served by
hypercorn in the server's Trio run, listen.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Reply
from onceflow.serve.http.api import (
    ROUTES,
    Commands,
    Receive,
    Scope,
    Send,
    UnauthorizedError,
    command_reply,
    get_route,
    read_body,
    reply_response,
    send_reply,
)
from onceflow.serve.http.graph import graph_svg, workflow_of
from onceflow.serve.http.openapi import openapi_bytes
from onceflow.serve.http.options import HttpOptions, Role
from onceflow.serve.http.sse import EventsEndpoint
from onceflow.serve.wire import refusal

ROLE_KEY = "onceflow.role"
"""Where the token check leaves the request's role in the ASGI scope."""

STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/board.js": ("board.js", "text/javascript; charset=utf-8"),
    "/board.css": ("board.css", "text/css; charset=utf-8"),
    "/docs": ("docs.html", "text/html; charset=utf-8"),
}
"""The pages served from the package (onceflow/serve/http/board/), without a token: they hold no data."""

SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' data: blob:; style-src 'self'; frame-ancestors 'none'",
    ),
]


class Gate:
    """The ASGI app's front: a request under /v1/ needs `Authorization: Bearer <token>` of a known token
    when the server has tokens (401 `unauthorized` otherwise); its role goes into the scope (`write` when
    the server has none). `POST /v1/commands[/{type}]` is answered here, the hot path, without the router
    (over HTTP/1.1 the listener answers it before it becomes an ASGI request: protocol.py, by `role` and
    `command`); the rest goes to `app`. Every response gets the security headers."""

    def __init__(self, app: Any, options: HttpOptions, commands: Commands) -> None:
        self._app, self._tokens, self._commands = app, options.tokens, commands
        self.max_body = options.max_body

    def role(self, path: str, headers: Iterable[tuple[bytes, bytes]]) -> Role | None:
        """The role of a request for `path`: its bearer token's under /v1/ when the server has tokens (None:
        it carries no known token), else `write`."""
        if not (self._tokens.required and path.startswith("/v1/")):
            return "write"
        role: Role | None = None
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    role = self._tokens.role_of(token.strip())
        return role

    async def command(self, path: str, role: Role, body: bytes | None) -> Reply:
        """The reply to `POST path` (a `command_path`) with `body` (None: longer than `max_body`)."""
        kind = path.removeprefix("/v1/commands/") if path != "/v1/commands" else None
        return await command_reply(body, self._commands, self.max_body, role, kind or None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope["path"]
        role = self.role(path, scope["headers"])
        if role is None:
            await send_reply(send, UNAUTHORIZED, [*SECURITY_HEADERS, WWW_AUTHENTICATE])
            return
        scope[ROLE_KEY] = role
        if scope["method"] == "POST" and command_path(path):
            body = await read_body(receive, scope["headers"], self.max_body)
            await send_reply(send, await self.command(path, role, body), SECURITY_HEADERS)
            return
        await self._app(scope, receive, _secured(send))


def command_path(path: str) -> bool:
    """Whether `path` is `/v1/commands` or `/v1/commands/{type}` (answered by `Gate.command` on POST)."""
    return path == "/v1/commands" or path.startswith("/v1/commands/")


UNAUTHORIZED = refusal("unknown", UnauthorizedError("a bearer token is required"))
WWW_AUTHENTICATE = (b"www-authenticate", b"Bearer")


def _secured(send: Send) -> Send:
    """`send` adding the security headers to the response's start."""

    async def secured(message: Any) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
        await send(message)

    return secured


def build_app(
    runtime: Runtime, commands: trio.Nursery, options: HttpOptions, stopping: trio.Event, grace: float
) -> Any:
    """The ASGI app serving `runtime`: commands run in `commands` (the server's command nursery); event
    streams end when `stopping` is set, or when a write waits `grace` seconds."""
    sender = Commands(runtime, commands)
    board = resources.files("onceflow.serve.http") / "board"
    pages = {path: ((board / name).read_bytes(), kind) for path, (name, kind) in STATIC.items()}
    document = openapi_bytes()

    def page(path: str) -> Any:
        body, kind = pages[path]

        async def endpoint(_: Request) -> Response:
            return Response(body, media_type=kind, headers={"Cache-Control": "no-cache"})

        return endpoint

    async def openapi(_: Request) -> Response:
        return Response(document, media_type="application/json")

    async def session(request: Request) -> Response:
        return JSONResponse({"role": request.scope[ROLE_KEY], "tokens": options.tokens.required})

    async def graph(request: Request) -> Response:
        data: dict[str, Any] = {"type": "get_workflow", "workflow_id": request.path_params["workflow_id"]}
        if "version" in request.query_params:
            version = request.query_params["version"]
            data["version"] = int(version) if version.isdigit() else version
        reply = await sender.send(data)
        workflow = workflow_of(reply.result) if reply.ok else None
        if workflow is None:
            return reply_response(reply)
        return Response(graph_svg(workflow), media_type="image/svg+xml")

    routes = [Route(path, page(path)) for path in STATIC]
    routes += [
        Route("/openapi.json", openapi),
        Route("/v1/session", session),
        Route("/v1/events", EventsEndpoint(runtime, stopping, options.heartbeat, grace)),
        Route("/v1/workflows/{workflow_id}/graph.svg", graph),
    ]
    routes += [Route(path, get_route(sender, build)) for path, (_, build) in ROUTES.items()]
    app: Any = Gate(Starlette(routes=routes), options, sender)
    if options.cors_origins:  # outside the token check: a preflight carries no token
        app = CORSMiddleware(
            app,
            allow_origins=list(options.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Last-Event-ID"],
        )
    return app
