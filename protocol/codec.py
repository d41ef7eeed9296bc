"""JSON-lines codec: one command or event per line.

`decode_command` turns a line into a typed command or raises `ProtocolError` naming the offending field;
`encode` writes any protocol model as one compact JSON line (no trailing newline).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from onceflow.protocol.commands import Command
from onceflow.protocol.errors import ProtocolError
from onceflow.protocol.events import Event, Reply

COMMAND_ADAPTER: TypeAdapter[Command] = TypeAdapter(Command)
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def decode_command(data: str | bytes | dict[str, Any]) -> Command:
    """Parse one command from a JSON line (or an already-decoded mapping).

    Raises:
        ProtocolError: invalid JSON (field None), an unknown or missing `type` (field "type"), or a field
            failing validation (field = its dotted path, e.g. "children.0.state").
    """
    if isinstance(data, str | bytes):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise ProtocolError(f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(data, dict):
        raise ProtocolError("a command must be a JSON object")
    try:
        return COMMAND_ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> ProtocolError:
    """Convert pydantic's first error into a ProtocolError naming the field (the union tag is dropped)."""
    first = exc.errors()[0]
    loc = [str(part) for part in first["loc"]]
    if first["type"] == "union_tag_not_found":
        return ProtocolError("missing field 'type' (the command name)", field="type")
    if first["type"] == "union_tag_invalid":
        return ProtocolError(f"unknown command type {first['input'].get('type')!r}", field="type")
    field = ".".join(loc[1:]) or None  # loc[0] is the command's type tag; a model-level error has no field
    return ProtocolError(f"{field}: {first['msg']}" if field else first["msg"], field=field)


def encode(model: BaseModel) -> str:
    """One compact JSON line for a command, event or reply."""
    return model.model_dump_json(exclude_none=False)


def command_schema() -> dict[str, Any]:
    """The JSON Schema of every command, every event and the reply (what `onceflow schema` prints)."""
    return {
        "command": COMMAND_ADAPTER.json_schema(),
        "event": EVENT_ADAPTER.json_schema(),
        "reply": Reply.model_json_schema(),
    }
