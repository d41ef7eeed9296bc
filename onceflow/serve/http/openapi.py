"""The OpenAPI 3.1 document of `onceflow serve --http`, generated from the same pydantic models `onceflow
schema` prints (`codec.command_schema`): every command as an operation, the resource routes, the events
stream. Pure (built once per server).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from onceflow.protocol.codec import command_schema
from onceflow.serve.http.api import READ_COMMANDS, ROUTES

REF = "#/components/schemas/"

PARAMETERS: dict[str, list[tuple[str, str, str]]] = {
    "/v1/tasks": [("after", "string", "a page's next_after_task_id"), ("limit", "integer", "1..1000")],
    "/v1/tasks/{task_id}/history": [("after", "string", "a page's next"), ("limit", "integer", "1..1000")],
    "/v1/runs": [
        ("task_id", "string", "only this task's runs"),
        ("agent_profile_id", "string", "only this agent's runs"),
        ("status", "string", "queued, claimed, finished, failed or cancelled"),
        ("after", "integer", "a page's next_after_run_id"),
        ("limit", "integer", "1..1000"),
    ],
    "/v1/host-calls": [
        ("status", "string", "only calls in this status (pending: those waiting)"),
        ("task_id", "string", "only this task's calls"),
        ("after", "integer", "a page's next_after_id"),
        ("limit", "integer", "1..1000"),
    ],
    "/v1/workflows/{workflow_id}": [("version", "integer", "a version (default: the current one)")],
}
"""Query parameters per resource route: (name, JSON type, what it is); each becomes its command's field."""


def _hoist(node: Any, defs: dict[str, Any]) -> Any:
    """`node` with every nested `$defs` moved into `defs` and its refs pointed at the components."""
    if isinstance(node, dict):
        for name, schema in node.pop("$defs", {}).items():
            hoisted = _hoist(schema, defs)
            if name in defs and defs[name] != hoisted:
                raise ValueError(f"two different schemas are named {name}")
            defs[name] = hoisted
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#/$defs/"):
                out[key] = REF + value.removeprefix("#/$defs/")
            elif key == "mapping" and isinstance(value, dict):
                out[key] = {k: REF + v.removeprefix("#/$defs/") for k, v in value.items()}
            else:
                out[key] = _hoist(value, defs)
        return out
    if isinstance(node, list):
        return [_hoist(item, defs) for item in node]
    return node


def _reply(result: dict[str, Any] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"$ref": REF + "Reply"}
    if result is not None:
        schema = {"allOf": [schema, {"properties": {"result": {"anyOf": [result, {"type": "null"}]}}}]}
    return {"content": {"application/json": {"schema": schema}}}


ERRORS = {
    "400": "invalid_message, workflow_invalid (a field names the culprit), or another refusal",
    "401": "unauthorized: a token is required and none, or an unknown one, was given",
    "403": "forbidden: a read-only token sent a command that writes",
    "404": "not_found",
    "409": "conflict, fence_required, wip_limit, transition_refused, transition_failed, host_refused",
    "413": "too_large: the request body is over the limit",
    "429": "busy or rate_limited: retry later (Retry-After)",
    "503": "a retryable fault (storage_busy, storage_io, shutting_down, host_unavailable, ...)",
}


def _responses(result: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": "the command's Reply (ok)", **_reply(result)}}
    for status, text in ERRORS.items():
        out[status] = {"description": f"the Reply with its error: {text}", **_reply()}
    return out


def openapi_document(title: str = "onceflow", version: str = "1") -> dict[str, Any]:
    """The OpenAPI 3.1 document (a fresh dict). Raises ValueError if two models share a name but differ."""
    sections = copy.deepcopy(command_schema())
    defs: dict[str, Any] = {}
    command = _hoist(sections["command"], defs)
    event = _hoist(sections["event"], defs)
    defs["Reply"] = _hoist(sections["reply"], defs)
    defs["Command"], defs["Event"] = command, event
    results: dict[str, Any] = {}
    for kind, schema in sections["results"].items():
        results[kind] = _hoist(schema, defs)
    security: list[dict[str, list[str]]] = [{"bearer": []}]
    paths: dict[str, Any] = {
        "/v1/commands": {
            "post": {
                "operationId": "send_command",
                "summary": "Send any command; the response is its Reply",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": REF + "Command"}}},
                },
                "responses": _responses(),
            }
        },
        "/v1/events": {
            "get": {
                "operationId": "events",
                "summary": "The event stream as Server-Sent Events (id = event_seq)",
                "description": (
                    "Each event is `id: <event_seq>` and `data: <Event JSON>`. Resumes after the "
                    "`Last-Event-ID` header (or the `after` query parameter) like the socket's "
                    "`subscribe after`: held events are replayed, then live ones follow, each once in seq "
                    "order. When some are gone an `event: gap` with data `{after, next}` comes first: read "
                    "durable state. A comment line every heartbeat keeps the connection open."
                ),
                "parameters": [
                    {"name": "after", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                    {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": {
                        "description": "the stream",
                        "content": {"text/event-stream": {"schema": {"$ref": REF + "Event"}}},
                    },
                    "400": {"description": "a bad after", **_reply()},
                },
            }
        },
    }
    for kind, ref in command["discriminator"]["mapping"].items():
        paths[f"/v1/commands/{kind}"] = {
            "post": {
                "operationId": kind,
                "summary": f"{kind}{' (read-only)' if kind in READ_COMMANDS else ''}",
                "description": f"The `{kind}` command; its body's `type` may be left out.",
                "tags": ["commands"],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": ref}}},
                },
                "responses": _responses(results.get(kind)),
            }
        }
    for path, (kind, _) in ROUTES.items():
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _path_names(path)
        ]
        parameters += [
            {"name": name, "in": "query", "description": text, "schema": {"type": kind_}}
            for name, kind_, text in PARAMETERS.get(path, [])
        ]
        paths[path] = {
            "get": {
                "operationId": "get_" + re.sub(r"[^a-z_]+", "_", path.removeprefix("/v1/")).strip("_"),
                "summary": f"The `{kind}` command's Reply",
                "tags": ["resources"],
                "parameters": parameters,
                "responses": _responses(results.get(kind)),
            }
        }
    return {
        "openapi": "3.1.0",
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {
            "title": title,
            "version": version,
            "description": "onceflow's protocol over HTTP: the socket's commands and Reply objects.",
        },
        "paths": paths,
        "components": {
            "schemas": dict(sorted(defs.items())),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": security,
    }


def _path_names(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


def openapi_bytes() -> bytes:
    """The document as compact JSON bytes (served at /openapi.json)."""
    return json.dumps(openapi_document(), separators=(",", ":")).encode()
