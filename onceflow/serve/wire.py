"""`onceflow serve`'s framing: splitting a byte stream into request lines, reading a request's `id`, and
the reply, event, gap and error lines (the wire contract is onceflow/serve/__init__.py's docstring). Trio
thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import trio

from onceflow.protocol.codec import command_type, encode, parse_json
from onceflow.protocol.errors import OnceflowError, ProtocolError, shown
from onceflow.protocol.event_stream import EventGap
from onceflow.protocol.events import ErrorInfo, Event, Reply
from onceflow.protocol.limits import MAX_ID_CHARS

MAX_ID_LENGTH = MAX_ID_CHARS
INT64 = range(-(2**63), 2**63)

HEAD_BYTES = 4096
"""How much of a line that cannot be read whole (longer than `max_line`, or not JSON) is scanned for its
`id` and `type` (`head_fields`)."""


@attrs.frozen
class Overlong:
    """Stands for a request line longer than `max_line` (already skipped); `head` is its first
    `HEAD_BYTES` bytes, where its `id` and `type` are looked for."""

    head: bytes


class LineReader:
    """Splits a byte stream into lines of at most `max_line` bytes; longer lines become `Overlong`.
    `received` is called for every chunk that arrives (activity, for the idle timeout)."""

    def __init__(
        self, stream: trio.abc.ReceiveStream, max_line: int, received: Callable[[], None] | None = None
    ) -> None:
        self._stream, self._max, self._received = stream, max_line, received
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline
        self._skipping = False  # inside an overlong line, dropping bytes up to its newline

    async def receive_line(self) -> bytes | Overlong | None:
        """The next line without its newline, an `Overlong` (with the line's head) once per overlong
        line, None at end of stream.

        Raises trio.BrokenResourceError / trio.ClosedResourceError as the stream does.
        """
        while True:
            newline = self._buffer.find(b"\n", self._scanned)
            if newline >= 0:
                line = bytes(self._buffer[:newline])
                del self._buffer[: newline + 1]
                self._scanned = 0
                if self._skipping:
                    self._skipping = False
                    continue
                return Overlong(line[:HEAD_BYTES]) if len(line) > self._max else line
            self._scanned = len(self._buffer)
            if self._scanned > max(self._max, HEAD_BYTES):  # a head as long whatever the chunking
                head = bytes(self._buffer[:HEAD_BYTES])
                self._buffer.clear()
                self._scanned = 0
                if not self._skipping:
                    self._skipping = True
                    return Overlong(head)
            chunk = await self._stream.receive_some(65536)
            if self._received is not None:
                self._received()
            if not chunk:
                tail, self._buffer = bytes(self._buffer), bytearray()
                if tail and not self._skipping:
                    return Overlong(tail[:HEAD_BYTES]) if len(tail) > self._max else tail  # no newline
                return None
            self._buffer += chunk


def reply_frame(request_id: str | int | None, reply: Reply) -> bytes:
    """The reply line: `{"id": ..., "reply": {...}}` plus newline."""
    return f'{{"id":{json.dumps(request_id)},"reply":{encode(reply)}}}\n'.encode()


def event_frame(seq: int, event: Event) -> bytes:
    """The event line: `{"event_seq": seq, "event": {...}}` plus newline."""
    return f'{{"event_seq":{seq},"event":{encode(event)}}}\n'.encode()


def gap_frame(gap: EventGap) -> bytes:
    """The gap line a subscription with `after` starts with when events after it are gone:
    `{"gap": {"after": N, "next": M}}` plus newline."""
    return f'{{"gap":{{"after":{gap.after},"next":{gap.next}}}}}\n'.encode()


def error_frame(error: ErrorInfo) -> bytes:
    """The connection's last line: `{"error": {"code", "message", "field", "retryable"}}` plus newline."""
    return f'{{"error":{encode(error)}}}\n'.encode()


def error_info(exc: OnceflowError) -> ErrorInfo:
    return ErrorInfo(code=exc.code, message=exc.message, field=exc.field, retryable=exc.retryable)


def refusal(command: str, exc: OnceflowError) -> Reply:
    return Reply(command=command, ok=False, error=error_info(exc))


@attrs.frozen
class Request:
    """One request line read: its `id`, and its JSON value without the `id` (what `Runtime.send` gets: the
    line is decoded once, within the protocol's bounds, `codec.parse_json`)."""

    id: str | int | None
    data: Any


@attrs.frozen
class Refused:
    """A request line answered without running it: the `id` its reply carries, and the reply."""

    id: str | int | None
    reply: Reply


def echoed_id(value: object) -> str:
    """What a reply to a line with an unacceptable `id` carries as its `id`: a string as it was sent,
    anything else as its compact JSON text (`1.5` -> "1.5", `[1]` -> "[1]")."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


_DECODER = json.JSONDecoder()
_MISSING = object()


def head_fields(head: bytes) -> tuple[object, object]:
    """The top-level `id` and `type` values of a line that cannot be read whole (`_MISSING` for one not
    found): the line's first members as far as they are complete in `head`, read as JSON one value at a
    time, in order, up to the first member that is cut off or malformed. So the reply to an overlong or
    broken line still carries the id (and names the command) a client sent at its start."""
    text = head.decode("utf-8", errors="replace")
    found: dict[str, object] = {}
    at = _skip_space(text, 0)
    if not text.startswith("{", at):
        return _MISSING, _MISSING
    at += 1
    try:
        while True:
            at = _skip_space(text, at)
            if not text.startswith('"', at):
                break
            key, at = _DECODER.raw_decode(text, at)  # a JSON string: the member's name
            at = _skip_space(text, at)
            if not text.startswith(":", at):
                break
            value, at = _DECODER.raw_decode(text, _skip_space(text, at + 1))
            found.setdefault(key, value)
            at = _skip_space(text, at)
            if not text.startswith(",", at):
                break
            at += 1
    except (ValueError, RecursionError):  # cut off or malformed: what was read before stands
        pass
    return found.get("id", _MISSING), found.get("type", _MISSING)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def acceptable_id(value: object) -> bool:
    """Whether a request's `id` is one a reply echoes as it is: None, a string of at most MAX_ID_LENGTH
    characters, or an int64 (not a bool)."""
    return (
        value is None
        or (isinstance(value, str) and len(value) <= MAX_ID_LENGTH)
        or (type(value) is int and value in INT64)
    )


def unreadable(head: bytes, exc: ProtocolError) -> Refused:
    """The refusal of a line that cannot be read whole (`head` its start): `id` the one it began with
    (itself when acceptable, else `echoed_id` of it; None when none was found), `command` its `type`
    (`command_type`), the error `exc`."""
    request_id, kind = head_fields(head)
    if request_id is _MISSING:
        shown_id: str | int | None = None
    elif acceptable_id(request_id):
        shown_id = request_id  # type: ignore[assignment]  # None, a str or an int64, as checked
    else:
        shown_id = echoed_id(request_id)
    command = command_type({"type": kind}) if kind is not _MISSING else "unknown"
    return Refused(shown_id, refusal(command, exc))


def split_request(line: bytes) -> Request | Refused:
    """Read a request line; Refused (`invalid_message`) when it is not JSON (`unreadable`: the id and type
    it began with are still echoed) or its `id` is unacceptable (then the reply's `id` is `echoed_id` of it
    and its `command` the line's `type`)."""
    try:
        data = parse_json(line)
    except ProtocolError as exc:  # bad JSON or UTF-8, nesting past the parser's depth, a NaN
        return unreadable(line[:HEAD_BYTES], exc)
    if not isinstance(data, dict) or "id" not in data:
        return Request(None, data)
    request_id = data.pop("id")
    if acceptable_id(request_id):
        return Request(request_id, data)
    error = ProtocolError(
        f"id must be a string of at most {MAX_ID_LENGTH} characters or a 64-bit integer, not "
        f"{shown(request_id)}",
        field="id",
    )
    return Refused(echoed_id(request_id), refusal(command_type(data), error))
