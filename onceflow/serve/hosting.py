"""`onceflow serve`'s host role on the wire: the `register_host` and `host_reply` lines
(protocol/host_calls.py) between a connection and the runtime's `HostBroker` (actors/runtime/host_broker.py),
which sends the calls. Trio thread.

`register_host` runs in the connection's pipeline like any request. A `host_reply` is answered as soon as it
is read, ahead of the connection's commands still waiting in its pipeline: a host's own command (a
`move_task` its preflight capability must answer) may be waiting on that very call.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from onceflow.actors.runtime.host_broker import HostBroker
from onceflow.protocol import trusted
from onceflow.protocol.codec import command_type, validation_error
from onceflow.protocol.errors import ConflictError, OnceflowError, ProtocolError, ShuttingDownError
from onceflow.protocol.events import Reply
from onceflow.protocol.host_calls import HostReply, RegisterHost
from onceflow.protocol.results import HostRegistered
from onceflow.serve.connection import Connection
from onceflow.serve.wire import Refused, acceptable_id, refusal, reply_frame, split_request

MARK = b'"host_reply"'
"""Only a line holding this text can be a `host_reply`: the read loop parses no other line early."""


def register(broker: HostBroker, conn: Connection, data: dict[str, Any]) -> Reply:
    """Answer a `register_host` request: the connection becomes a host with its capabilities (`host_id` in
    the result), or the request is refused (`invalid_message` naming the field; `conflict` when the
    connection is a host already)."""
    try:
        request = RegisterHost.model_validate(data)
    except ValidationError as exc:
        return refusal("register_host", validation_error(exc, tagged=False, model=RegisterHost))
    if conn.host is not None:
        already = ConflictError(f"this connection is already registered as {conn.host.host_id}", field="type")
        return refusal("register_host", already)
    host = conn.host = broker.register(request.capabilities, conn)
    conn.on_fail = lambda: broker.unregister(host)
    result: HostRegistered = {"host_id": host.host_id, "capabilities": list(request.capabilities)}
    return Reply(command="register_host", ok=True, result=result)


def answer(broker: HostBroker, conn: Connection, line: bytes) -> bytes | None:
    """The reply line to a `host_reply` request line, or None when `line` is no readable `host_reply` with an
    acceptable id (it goes to the pipeline, which answers it as any request, malformed or not).

    A refusal changes nothing: a bad shape (`invalid_message` naming the field), a connection that is not a
    registered host (`invalid_message`, field `type`), an unknown call (`not_found`, field `call_id`), a
    call already answered, ended or held by another host (`conflict`, field `call_id`)."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("type") != "host_reply":
        return None
    request_id = data.pop("id", None)
    if not acceptable_id(request_id):
        return None
    try:
        reply = HostReply.model_validate(data)
        if conn.host is None:
            raise ProtocolError(
                "host_reply from a connection that is not a host: send register_host first", field="type"
            )
        taken = broker.answer(conn.host, reply)
    except ValidationError as exc:
        return reply_frame(
            request_id, refusal("host_reply", validation_error(exc, tagged=False, model=HostReply))
        )
    except OnceflowError as exc:
        return reply_frame(request_id, refusal("host_reply", exc))
    return reply_frame(request_id, trusted.reply("host_reply", [], result=taken))


def stopping(line: bytes) -> bytes:
    """The reply line to a request a host connection sends while the server drains (only its answers to
    calls are still taken): `shutting_down`."""
    request = split_request(line)
    command = request.reply.command if isinstance(request, Refused) else command_type(request.data)
    return reply_frame(request.id, refusal(command, ShuttingDownError("the server is shutting down")))
