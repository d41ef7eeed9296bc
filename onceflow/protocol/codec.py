"""JSON-lines codec: one command or event per line. Pure.

`decode_command` turns a line (or a mapping) into a typed command or raises `ProtocolError` naming the
offending field; `encode` writes any protocol model as one compact JSON line (no trailing newline).
A line is bounded before it is validated: UTF-8, at most `MAX_MESSAGE_BYTES`, nested at most
`MAX_JSON_DEPTH` levels, no NaN/Infinity; an integer literal too long for int64 is kept as an out-of-range
value so the field's int64 bound names it.
"""

from __future__ import annotations

import json
from typing import Any, get_args

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from onceflow.protocol.commands import Command
from onceflow.protocol.errors import ProtocolError, shown
from onceflow.protocol.events import Event, Reply
from onceflow.protocol.limits import INT64_MAX, INT64_MIN, MAX_ID_CHARS, MAX_JSON_DEPTH, MAX_MESSAGE_BYTES
from onceflow.protocol.results import results_schema
from onceflow.protocol.suggest import did_you_mean, keys_at

COMMAND_ADAPTER: TypeAdapter[Command] = TypeAdapter(Command)
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

_NESTED = (dict, list, tuple)
_validate_command = COMMAND_ADAPTER.validator.validate_python
"""`COMMAND_ADAPTER.validate_python` without the adapter's Python layer (~3.5k instructions a command)."""
_INT64_DIGITS = len(str(INT64_MIN))  # "-9223372036854775808": 20 characters


def decode_command(data: object) -> Command:
    """Parse one command from a JSON line (str or bytes) or an already-decoded mapping.

    Raises:
        ProtocolError: not UTF-8, too large, too deeply nested or not JSON (field None), an unknown or
            missing `type` (field "type"), or a field failing validation (field = its dotted path, e.g.
            "children.0.state"; an integer outside int64 fails its field's bound).
    """
    if isinstance(data, (str, bytes)):
        data = parse_json(data)
    if not isinstance(data, dict):
        raise ProtocolError(f"a command must be a JSON object, not {type(data).__name__}")
    for value in data.values():  # a flat command (the common case) is one level deep: no walk
        if isinstance(value, _NESTED):  # a tuple: an `X | Y` union is built at each call
            check_depth(data)
            break
    kind = data.get("type")
    if kind is not None and not isinstance(kind, str):  # pydantic would print it, even a 5,000-digit int
        raise ProtocolError(f"type must be the command's name, not {type(kind).__name__}", field="type")
    try:
        return _validate_command(data)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise validation_error(exc) from None


def command_type(data: object) -> str:
    """What a reply's `command` says for a decoded message: its `type` whenever that is a string shaped
    like a name (1 to MAX_ID_CHARS printable characters: no control character, no lone surrogate), known
    command or not; `unknown` when the message is not an object, has no such `type`, or its `type` is no
    name (an 8 MiB string, a newline)."""
    kind = data.get("type") if isinstance(data, dict) else None
    if isinstance(kind, str) and 0 < len(kind) <= MAX_ID_CHARS and kind.isprintable():
        return kind
    return "unknown"


def parse_json(line: str | bytes) -> Any:
    """Decode one JSON text within the protocol's bounds; raises ProtocolError."""
    _check_size(len(line))  # a str's length in characters never exceeds its length in UTF-8 bytes
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"not valid UTF-8: byte {exc.start} cannot be decoded") from None
    elif 4 * len(line) > MAX_MESSAGE_BYTES:  # only then can its UTF-8 exceed the limit
        _check_size(len(line.encode("utf-8", "surrogatepass")))
    try:
        return json.loads(line, parse_int=_bounded_int, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:  # the C scanner's own depth guard, long before MAX_JSON_DEPTH is checked
        raise ProtocolError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None


def _check_size(size: int) -> None:
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a message is at most {MAX_MESSAGE_BYTES} bytes of UTF-8, this one has {size}")


def _bounded_int(literal: str) -> int:
    """An int64-sized literal as its value; a longer one as a value just outside int64 (no 5,000-digit
    conversion, which Python refuses anyway), so the field's bound reports it."""
    if len(literal) <= _INT64_DIGITS:
        return int(literal)
    return INT64_MIN - 1 if literal.startswith("-") else INT64_MAX + 1


def _refuse_constant(name: str) -> Any:
    raise ProtocolError(f"not valid JSON: {name} is not a JSON number")


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise ProtocolError when lists/dicts in `value` nest deeper than `limit` (iterative: no recursion;
    a container reached twice, as a mapping a host built may share, is walked once)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen: set[int] = set()
    while stack:
        node, depth = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if depth > limit:
            raise ProtocolError(f"JSON nested deeper than {limit} levels")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list | tuple))


def validation_error(
    exc: ValidationError, *, tagged: bool = True, model: type[BaseModel] | None = None
) -> ProtocolError:
    """Convert pydantic's first error into a ProtocolError naming the field (the union tag is dropped when
    `tagged`: the error comes from decoding through the command union; else the location is the field's,
    inside `model` when given).

    An unknown command type or field says the closest known name (`unknown command type 'move_tsk' (did
    you mean 'move_task'?)`, `unknown field 'stepid' (did you mean 'step_id'?)`); an unknown field close to
    a known one is reported before the "Field required" of the field it misspells. Values and unknown keys
    the host sent are shown escaped and cut short (`errors.shown`).
    """
    errors = exc.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden" and _hint(e, tagged, model)), errors[0])
    loc = [_field_part(part) for part in first["loc"]]
    if first["type"] == "union_tag_not_found":
        return ProtocolError("missing field 'type' (the command name)", field="type")
    if first["type"] == "union_tag_invalid":
        kind = first["input"].get("type")
        return ProtocolError(
            f"unknown command type {shown(kind)}{did_you_mean(kind, _COMMAND_MODELS)}", field="type"
        )
    field = ".".join(loc[1:] if tagged else loc) or None  # loc[0]: the union's tag; a model's error: none
    if first["type"] == "extra_forbidden" and field:
        return ProtocolError(f"{field}: unknown field{_hint(first, tagged, model)}", field=field)
    return ProtocolError(f"{field}: {first['msg']}" if field else first["msg"], field=field)


def _hint(error: ErrorDetails, tagged: bool, model: type[BaseModel] | None) -> str:
    """ " (did you mean 'x'?)" for an unknown field, from the fields its model accepts there; or ""."""
    loc = list(error["loc"])
    if tagged:
        model = _COMMAND_MODELS.get(str(loc[0])) if loc else None
        loc = loc[1:]
    if model is None or not loc:
        return ""
    return did_you_mean(loc[-1], keys_at(model, loc[:-1]))


_COMMAND_MODELS: dict[str, type[BaseModel]] = {
    model.model_fields["type"].default: model for model in get_args(get_args(Command)[0])
}
"""Each command type's model, by its `type`."""


def _field_part(part: str | int) -> str:
    """One location part; a key the host made up is shown escaped unless it is short and printable."""
    text = str(part)
    return text if text.isprintable() and len(text) <= MAX_ID_CHARS else shown(text)


def encode(model: BaseModel) -> str:
    """One compact JSON line for a command, event or reply."""
    return model.model_dump_json(exclude_none=False)


def command_schema() -> dict[str, Any]:
    """The JSON Schema of every command, every event, the reply, and per command type its reply's `result`
    (what `onceflow schema` prints; each section a standalone schema with its own `$defs`)."""
    return {
        "command": COMMAND_ADAPTER.json_schema(),
        "event": EVENT_ADAPTER.json_schema(),
        "reply": Reply.model_json_schema(),
        "results": results_schema(),
    }
