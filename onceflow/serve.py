"""`onceflow serve`: the protocol as JSON lines over a Unix domain socket or stdin/stdout. Trio thread: one
Trio run owning the runtime and every connection.

Wire format (one JSON object per line, UTF-8, `\\n`-terminated; a blank line is ignored):

- Request: any command object, optionally with an `"id"` (a string of at most 256 characters, or an
  integer in the int64 range) that the reply echoes; the `id` is removed before the command is decoded.
  `{"type": "subscribe"}` asks for the event stream on this connection.
- Reply to a request: `{"id": <id or null>, "reply": <Reply>}`, the same `Reply` model `Runtime.send`
  returns in process; its `command` is the `type` the line named whenever it named one, known or not. A
  line that is not JSON, names an unknown command or has a bad field gets an `invalid_message` reply and
  the connection stays open; `id` is null only when the line had none. A line that is not JSON (or is
  too long, below) is still scanned from its start for its top-level members: the `id` and `type` among
  those complete in its first 4 KiB are echoed and named as for a readable line.
- A bad `id` (a float, an integer outside int64, a boolean, an array or object, a string over 256
  characters) gets `invalid_message` with field `id`, and the command does not run. Its reply's `id` is
  what was sent, as a string a client can match: a string id itself, any other value its compact JSON
  text as Python writes it (`1.5` -> `"1.5"`, `2**64` -> `"18446744073709551616"`, `[1]` -> `"[1]"`,
  `true` -> `"true"`).
- A line longer than `max_line` bytes gets `invalid_message` (its `id` and `command` as found at its
  start, above) and is skipped up to its newline. By default `max_line` is the protocol's own message limit,
  `protocol.limits.MAX_MESSAGE_BYTES` (8 MiB): any line the runtime accepts is read.
- Event (after `subscribe`): `{"event": <Event>}`, every event the runtime emits from then on.
- Connection error, the last line before the server closes the connection: `{"error": <ErrorInfo>}`;
  `slow_consumer` when the client stopped reading and its outgoing queue filled, `idle_timeout` when it
  sent nothing and had nothing in flight for `idle_timeout` seconds, `busy` (retryable) when the server
  already serves `max_connections` clients: that connection gets this one line and is closed.

A connection's commands are applied one at a time in the order received (as a host awaiting each
`Runtime.send` in turn would), and replied to in that order; for parallelism open more connections. Up
to `max_pipeline` received lines, and `max_line` bytes of them, wait their turn; past that the server
stops reading that connection (the socket's own flow control), and no other client is slowed. Each
connection's commands run in a task of the server's, never cancelled by the client going away: a client
that disconnects mid-command loses nothing that committed — what it had sent still runs and commits;
the replies are dropped.

Bounds, per connection unless said: outgoing, at most `queue_size` lines and `queue_bytes` bytes
(each frame counted at its full encoded size, from when it is queued until the socket took all of it)
wait for the client; a frame that would pass either limit, a single frame larger than `queue_bytes`
included, makes the client a slow consumer: it is sent the `slow_consumer` error line after what is
queued (if it reads within `grace` seconds) and disconnected. Nothing the runtime does ever waits on a
client. Incoming, the line being read (`max_line` bytes) and the pipeline above. At most
`max_connections` connections at once; the listen backlog is `backlog`. A socket connection is idle
when no byte arrives from it, no command of it is pending or running, nothing is queued for it and it
has no subscription (a subscriber waits for events; a subscriber that stops reading is a slow consumer
once events flow); after `idle_timeout` seconds idle (0: never) it gets the `idle_timeout` error line
and is closed. Any line, even a blank one, counts as activity. The one `--stdio` client is never idle.
When accept fails for want of file descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) the server
stops accepting for a moment (10 ms, doubling up to 1 s, until an accept succeeds), logging one WARNING
`accept_paused` per episode and an INFO `accept_resumed` at its end; connected clients are served
meanwhile and new ones wait in the backlog.

SIGTERM or SIGINT: stop accepting and reading, let every received command finish and its reply be
written (clients get `grace` seconds to read them), close the store, remove the socket file, exit 0. A
second signal cancels what is left (the store still finishes or rolls back each transaction whole).
At start, after the workflows are registered, one line `serving on PATH` (or `serving on stdio`) goes to
stderr. The socket file is created with mode 0600 (owner only); a stale socket file is replaced, a live
one (another server answers) is an error.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
from opentelemetry.trace import TracerProvider

from onceflow.actors.runtime.startup import SWITCH_INTERVAL, open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.logs import get_logger
from onceflow.protocol.codec import command_type, encode
from onceflow.protocol.durations import seconds
from onceflow.protocol.errors import BusyError, OnceflowError, ProtocolError, shown
from onceflow.protocol.events import ErrorInfo, Event, Reply
from onceflow.protocol.limits import MAX_ID_CHARS, MAX_MESSAGE_BYTES
from onceflow.store.urls import database_arg

log = get_logger("onceflow.serve")

MAX_ID_LENGTH = MAX_ID_CHARS
INT64 = range(-(2**63), 2**63)
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""accept(2) failures that mean "no file descriptor or memory right now": accepting pauses, then retries."""
REFUSE_SECONDS = 1.0
"""How long a connection over `max_connections` gets to take its one `busy` line before it is closed."""


class SlowConsumerError(OnceflowError):
    """The client stopped reading and its outgoing queue filled (`--queue-size` lines or `--queue-bytes`
    bytes); the server disconnects it."""

    code = "slow_consumer"


class IdleTimeoutError(OnceflowError):
    """The client sent nothing and had nothing in flight for `--idle-timeout` seconds; the server closes
    it."""

    code = "idle_timeout"


def _nonnegative_seconds(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a finite number of seconds >= 0, not {value!r}")


@attrs.frozen
class ServeOptions:
    """Per-connection and server bounds (the module docstring says what each does).

    `queue_size` outgoing lines and `queue_bytes` outgoing bytes a client may lag behind; `max_line` bytes
    in one request line (default and at most the protocol's message limit, `MAX_MESSAGE_BYTES`, its one
    owner: a line serve reads is never one the runtime refuses for its size; ValueError beyond it);
    `max_pipeline` received lines waiting to be applied; `grace` seconds a disconnecting client (slow,
    idle, or at shutdown) gets to read what is queued; `max_connections` clients at once; `idle_timeout`
    seconds without activity before a client is closed (0: never); `backlog` connections the kernel
    queues before they are accepted.
    """

    queue_size: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    queue_bytes: int = attrs.field(default=8 << 20, validator=attrs.validators.ge(1))
    max_line: int = attrs.field(
        default=MAX_MESSAGE_BYTES, validator=[attrs.validators.ge(1), attrs.validators.le(MAX_MESSAGE_BYTES)]
    )
    max_pipeline: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    grace: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    max_connections: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    idle_timeout: float = attrs.field(default=300.0, validator=_nonnegative_seconds)
    backlog: int = attrs.field(default=512, validator=attrs.validators.ge(1))


HEAD_BYTES = 4096
"""How much of a line that cannot be read whole (longer than `max_line`, or not JSON) is scanned for its
`id` and `type` (`head_fields`)."""


@attrs.frozen
class _Overlong:
    """Stands for a request line longer than `max_line` (already skipped); `head` is its first
    `HEAD_BYTES` bytes, where its `id` and `type` are looked for."""

    head: bytes


class _LineReader:
    """Splits a byte stream into lines of at most `max_line` bytes; longer lines become `_Overlong`.
    `received` is called for every chunk that arrives (activity, for the idle timeout)."""

    def __init__(
        self, stream: trio.abc.ReceiveStream, max_line: int, received: Callable[[], None] | None = None
    ) -> None:
        self._stream, self._max, self._received = stream, max_line, received
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline
        self._skipping = False  # inside an overlong line, dropping bytes up to its newline

    async def receive_line(self) -> bytes | _Overlong | None:
        """The next line without its newline, an `_Overlong` (with the line's head) once per overlong
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
                return _Overlong(line[:HEAD_BYTES]) if len(line) > self._max else line
            self._scanned = len(self._buffer)
            if self._scanned > max(self._max, HEAD_BYTES):  # a head as long whatever the chunking
                head = bytes(self._buffer[:HEAD_BYTES])
                self._buffer.clear()
                self._scanned = 0
                if not self._skipping:
                    self._skipping = True
                    return _Overlong(head)
            chunk = await self._stream.receive_some(65536)
            if self._received is not None:
                self._received()
            if not chunk:
                tail, self._buffer = bytes(self._buffer), bytearray()
                if tail and not self._skipping:
                    return _Overlong(tail[:HEAD_BYTES]) if len(tail) > self._max else tail  # no newline
                return None
            self._buffer += chunk


def reply_frame(request_id: str | int | None, reply: Reply) -> bytes:
    """The reply line: `{"id": ..., "reply": {...}}` plus newline."""
    return f'{{"id":{json.dumps(request_id)},"reply":{encode(reply)}}}\n'.encode()


def event_frame(event: Event) -> bytes:
    """The event line: `{"event": {...}}` plus newline."""
    return f'{{"event":{encode(event)}}}\n'.encode()


def error_frame(error: ErrorInfo) -> bytes:
    """The connection's last line: `{"error": {"code", "message", "field", "retryable"}}` plus newline."""
    return f'{{"error":{encode(error)}}}\n'.encode()


def _info(exc: OnceflowError) -> ErrorInfo:
    return ErrorInfo(code=exc.code, message=exc.message, field=exc.field, retryable=exc.retryable)


def _refusal(command: str, exc: OnceflowError) -> Reply:
    return Reply(command=command, ok=False, error=_info(exc))


@attrs.frozen
class Request:
    """One request line read: its `id`, its JSON value without the `id`, and the line `Runtime.send`
    gets (the line itself, or the value re-encoded when an `id` was removed)."""

    id: str | int | None
    data: Any
    line: bytes | str


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


def _acceptable_id(value: object) -> bool:
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
    elif _acceptable_id(request_id):
        shown_id = request_id  # type: ignore[assignment]  # None, a str or an int64, as checked
    else:
        shown_id = echoed_id(request_id)
    command = command_type({"type": kind}) if kind is not _MISSING else "unknown"
    return Refused(shown_id, _refusal(command, exc))


def split_request(line: bytes) -> Request | Refused:
    """Read a request line; Refused (`invalid_message`) when it is not JSON (`unreadable`: the id and type
    it began with are still echoed) or its `id` is unacceptable (then the reply's `id` is `echoed_id` of it
    and its `command` the line's `type`)."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8; nesting past the parser's depth
        return unreadable(line[:HEAD_BYTES], ProtocolError(f"not valid JSON: {exc}"))
    if not isinstance(data, dict) or "id" not in data:
        return Request(None, data, line)
    request_id = data.pop("id")
    if _acceptable_id(request_id):
        return Request(request_id, data, json.dumps(data))
    error = ProtocolError(
        f"id must be a string of at most {MAX_ID_LENGTH} characters or a 64-bit integer, not "
        f"{shown(request_id)}",
        field="id",
    )
    return Refused(echoed_id(request_id), _refusal(command_type(data), error))


@attrs.define(eq=False)
class _Connection:
    """One client: its stream, its bounded queues, what it has in flight, and the scopes that stop it."""

    number: int  # the n-th connection since start, for the logs
    stream: trio.abc.Stream
    nursery: trio.Nursery
    out: trio.MemorySendChannel[bytes]
    queued: trio.MemoryReceiveChannel[bytes]
    options: ServeOptions
    reading: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    writing: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    watching: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    subscription: trio.CancelScope | None = None
    failure: ErrorInfo | None = None
    out_bytes: int = 0  # queued for the client, not yet taken by the socket
    peak_out_bytes: int = 0
    pending: int = 0  # received lines not yet answered (waiting, or running)
    pending_bytes: int = 0  # of which waiting in the pipeline or running
    freed: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)
    last_active: float = attrs.field(factory=trio.current_time)

    def push(self, frame: bytes) -> None:
        """Queue a line for the client without ever waiting; past `queue_size` lines or `queue_bytes`
        bytes the client is a slow consumer and is disconnected."""
        if self.failure is not None:
            return
        size, limit = len(frame), self.options.queue_bytes
        if self.out_bytes + size > limit:
            held = f"{self.out_bytes} bytes wait for it" if self.out_bytes else f"a line of {size} bytes"
            self.fail(
                SlowConsumerError(f"the client is not reading fast enough: {held}, the limit is {limit}")
            )
            return
        try:
            self.out.send_nowait(frame)
        except trio.WouldBlock:
            self.fail(SlowConsumerError("the client stopped reading and its outgoing queue is full"))
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the client is gone or the connection is closing: the line has nowhere to go
        self.out_bytes += size
        self.peak_out_bytes = max(self.peak_out_bytes, self.out_bytes)

    def fail(self, exc: OnceflowError) -> None:
        """Disconnect: read nothing more, send nothing new, flush what is queued plus the error line."""
        self.failure = _info(exc)
        log.warning(
            "client_disconnected",
            connection=self.number,
            code=exc.code,
            reason=exc.message,
            queued_bytes=self.out_bytes,
            peak_queued_bytes=self.peak_out_bytes,
            queue_bytes=self.options.queue_bytes,
        )
        self.reading.cancel()
        self.end_subscription()
        self.close_within(self.options.grace)

    def end_subscription(self) -> None:
        if self.subscription is not None:
            self.subscription.cancel()

    def close_within(self, seconds: float) -> None:
        self.writing.deadline = min(self.writing.deadline, trio.current_time() + seconds)

    def touch(self) -> None:
        """Something happened on the connection: its idle time starts again."""
        self.last_active = trio.current_time()

    def busy(self) -> bool:
        """Whether the connection has something in flight: a command, a queued line or a subscription."""
        return bool(self.pending or self.out_bytes or self.subscription is not None)

    async def admit(self, size: int) -> None:
        """Wait until `size` more received bytes fit in the pipeline's `max_line` (one line always fits)."""
        while self.pending_bytes and self.pending_bytes + size > self.options.max_line:
            await self.freed.park()
        self.pending += 1
        self.pending_bytes += size

    def answered(self, size: int) -> None:
        self.pending -= 1
        self.pending_bytes -= size
        self.freed.unpark_all()
        self.touch()


class Server:
    """Serves one runtime to many connections; see the module docstring for the wire contract."""

    def __init__(self, runtime: Runtime, commands: trio.Nursery, options: ServeOptions) -> None:
        self._runtime = runtime
        self._commands = commands  # lives until every received command is done; a client never cancels it
        self._options = options
        self._connections: set[_Connection] = set()
        self._opened = 0
        self._refused = 0  # connections refused since the server was last below max_connections
        self.stopping = False

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._connections)

    def stop(self) -> None:
        """Stop reading every connection; each finishes the commands it received, then closes."""
        self.stopping = True
        for conn in self._connections:
            conn.reading.cancel()
            conn.close_within(self._options.grace)

    async def handle(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until it ends (EOF, error, slow consumer, idle, or shutdown), then close
        it; over `max_connections`, send it the one `busy` line and close it."""
        if len(self._connections) >= self._options.max_connections:
            await self._refuse(stream)
            return
        if self._refused:
            log.info("connections_below_cap", refused=self._refused, connections=len(self._connections))
            self._refused = 0
        out, queued = trio.open_memory_channel[bytes](self._options.queue_size)
        requests, received = trio.open_memory_channel[bytes | _Overlong](self._options.max_pipeline)
        worked = trio.Event()
        self._opened += 1
        try:
            async with trio.open_nursery() as nursery:
                conn = _Connection(self._opened, stream, nursery, out, queued, self._options)
                self._connections.add(conn)
                try:
                    if self.stopping:
                        conn.reading.cancel()
                    nursery.start_soon(self._write, conn)
                    if self._options.idle_timeout:
                        nursery.start_soon(self._watch_idle, conn)
                    self._commands.start_soon(self._work, conn, received, worked)
                    with conn.reading:
                        await self._read(conn, requests)
                    requests.close()
                    await worked.wait()  # every received command answered (or its reply dropped)
                    conn.watching.cancel()
                    conn.end_subscription()
                    out.close()  # the writer flushes the queue (and any error line), then stops
                finally:
                    self._connections.discard(conn)
        finally:
            await trio.aclose_forcefully(stream)

    async def _refuse(self, stream: trio.abc.Stream) -> None:
        limit = self._options.max_connections
        if not self._refused:
            log.warning("connections_at_cap", max_connections=limit)
        self._refused += 1
        busy = BusyError(f"the server already serves its limit of {limit} connections; retry later")
        with (
            trio.move_on_after(REFUSE_SECONDS),
            contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
        ):
            await stream.send_all(error_frame(_info(busy)))
        await trio.aclose_forcefully(stream)

    async def _read(self, conn: _Connection, requests: trio.MemorySendChannel[bytes | _Overlong]) -> None:
        lines = _LineReader(conn.stream, self._options.max_line, conn.touch)
        while True:
            try:
                line = await lines.receive_line()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if line is None:
                return
            if isinstance(line, _Overlong) or line.strip():
                size = 0 if isinstance(line, _Overlong) else len(line)
                await conn.admit(size)  # waits while max_line bytes are pending: backpressure
                try:
                    await requests.send(line)  # waits while max_pipeline lines are pending
                except BaseException:  # cancelled (shutdown, slow consumer): the line is never applied
                    conn.answered(size)
                    raise

    async def _work(
        self, conn: _Connection, received: trio.MemoryReceiveChannel[bytes | _Overlong], worked: trio.Event
    ) -> None:
        """Apply the connection's requests in order; runs in the server's command nursery."""
        try:
            async for line in received:
                conn.push(await self._answer(conn, line))
                conn.answered(0 if isinstance(line, _Overlong) else len(line))
        finally:
            worked.set()

    async def _answer(self, conn: _Connection, line: bytes | _Overlong) -> bytes:
        if isinstance(line, _Overlong):
            refused = unreadable(line.head, ProtocolError(f"line longer than {self._options.max_line} bytes"))
            return reply_frame(refused.id, refused.reply)
        request = split_request(line)
        if isinstance(request, Refused):
            return reply_frame(request.id, request.reply)
        if isinstance(request.data, dict) and request.data.get("type") == "subscribe":
            return reply_frame(request.id, self._subscribe(conn, request.data))
        reply = await self._runtime.send(request.line)  # never raises; the codec's own bounds apply
        return reply_frame(request.id, reply)

    def _subscribe(self, conn: _Connection, request: dict[str, Any]) -> Reply:
        extra = sorted(set(request) - {"type"})
        if extra:
            return _refusal("subscribe", ProtocolError(f"{extra[0]}: unknown field", field=extra[0]))
        if conn.subscription is None:
            conn.subscription = trio.CancelScope()
            conn.nursery.start_soon(self._pump, conn, conn.subscription, self._runtime.subscribe())
        return Reply(command="subscribe", ok=True, result={"subscribed": True})

    async def _pump(
        self, conn: _Connection, scope: trio.CancelScope, events: trio.MemoryReceiveChannel[Event]
    ) -> None:
        with scope, events:
            async for event in events:
                conn.push(event_frame(event))

    async def _write(self, conn: _Connection) -> None:
        with conn.writing:
            try:
                async for frame in conn.queued:
                    await conn.stream.send_all(frame)
                    conn.out_bytes -= len(frame)
                    conn.touch()
                if conn.failure is not None:
                    await conn.stream.send_all(error_frame(conn.failure))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away; its commands still run, their replies are dropped
        conn.queued.close()
        if conn.writing.cancelled_caught:
            log.warning("client_not_reading_closed", connection=conn.number, grace_seconds=conn.options.grace)

    async def _watch_idle(self, conn: _Connection) -> None:
        """Close the connection once it has been idle (`_Connection.busy` false, nothing received) for
        `idle_timeout` seconds. Never closes early: a busy connection is looked at again a timeout later,
        and the timeout counts from its last activity."""
        timeout = self._options.idle_timeout
        with conn.watching:
            while True:
                now = trio.current_time()
                deadline = now + timeout if conn.busy() else conn.last_active + timeout
                if deadline <= now:
                    conn.fail(IdleTimeoutError(f"nothing was sent or in flight for {timeout:g} seconds"))
                    return
                await trio.sleep_until(deadline)


async def _bind(path: Path, backlog: int = ServeOptions().backlog) -> trio.SocketListener:
    """Listen on `path` (mode 0600, `backlog` pending connections), replacing a stale socket file. Raises
    OSError if another server answers there, if `path` is some other file, or if it cannot be bound (e.g.
    longer than ~107 bytes)."""
    if path.is_socket():
        try:
            probe = await trio.open_unix_socket(str(path))
        except OSError:
            path.unlink()  # nobody listens: left by a server that was killed
        else:
            await probe.aclose()
            raise OSError(f"{path}: another server is listening there")
    elif path.exists() or path.is_symlink():
        raise FileExistsError(f"{path}: exists and is not a socket")
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    previous = os.umask(0o177)  # the socket file is born 0600: only its owner may connect
    try:
        await sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(previous)
    sock.listen(backlog)
    return trio.SocketListener(sock)


async def _register(runtime: Runtime, workflows: Sequence[Path]) -> bool:
    for path in workflows:
        reply = await runtime.send(
            {"type": "register_workflow", "yaml": path.read_text(), "source": str(path)}
        )
        if not reply.ok:
            assert reply.error is not None
            print(f"error: {path}: {reply.error.message}", file=sys.stderr)
            return False
    return True


async def serve(
    db: Path,
    workflows: Sequence[Path],
    *,
    socket_path: Path | None = None,
    options: ServeOptions = ServeOptions(),
    switch_interval: float | None = SWITCH_INTERVAL,
    tracer_provider: TracerProvider | None = None,
) -> int:
    """Serve the runtime on `db` over `socket_path`, or over stdin/stdout when it is None (the one
    connection's end then ends the server), until SIGTERM/SIGINT. Returns the exit status: 0 after a
    clean shutdown, 1 if a workflow is refused. `switch_interval`: the GIL switch interval in seconds while
    serving (`open_runtime`; the process is the server's own), None for Python's. `tracer_provider`: where
    the runtime's spans go (None: the global one, e.g. as `opentelemetry-instrument` sets it); a request's
    `traceparent` is its command span's parent (onceflow/tracing.py).

    Raises DatabaseOwnedError (another runtime owns `db`), OSError (the socket cannot be bound; a
    workflow file cannot be read).
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:  # queued until watched
        listener = None if socket_path is None else await _bind(socket_path, options.backlog)
        try:
            # Opened outside any nursery, so its errors surface as themselves, not in an ExceptionGroup.
            async with open_runtime(
                db, switch_interval=switch_interval, tracer_provider=tracer_provider
            ) as runtime:
                if not await _register(runtime, workflows):
                    return 1
                async with trio.open_nursery() as everything:
                    stopped = trio.Event()
                    everything.start_soon(_watch_signals, signals, stopped, everything.cancel_scope)
                    await _serve(runtime, listener, socket_path, options, stopped)
                    everything.cancel_scope.cancel()  # the signal watcher
        finally:
            if socket_path is not None:
                socket_path.unlink(missing_ok=True)
    return 0


async def _watch_signals(signals: Any, stopped: trio.Event, everything: trio.CancelScope) -> None:
    async for signum in signals:
        if stopped.is_set():
            log.warning("second_signal_cancelling", signal=signum)
            everything.cancel()
            return
        log.info("signal_draining", signal=signum)
        stopped.set()


async def _serve(
    runtime: Runtime,
    listener: trio.SocketListener | None,
    socket_path: Path | None,
    options: ServeOptions,
    stopped: trio.Event,
) -> None:
    """Serve until `stopped`, then drain: returns once every received command is done and answered. Over
    stdio the one client, whose end ends the server, is never timed out."""
    if listener is None:
        options = attrs.evolve(options, idle_timeout=0.0)
    async with trio.open_nursery() as commands:
        server = Server(runtime, commands, options)
        async with trio.open_nursery() as connections:
            accepting = trio.CancelScope()
            if listener is None:
                connections.start_soon(_serve_stdio, server, stopped)
            else:
                connections.start_soon(_accept, server, listener, accepting, connections)
            print(f"serving on {socket_path or 'stdio'}", file=sys.stderr, flush=True)
            await stopped.wait()
            server.stop()
            accepting.cancel()


@attrs.define
class AcceptPause:
    """How accepting waits out a shortage of file descriptors or memory: `first` seconds, doubling up to
    `cap`, until an accept succeeds. One WARNING `accept_paused` starts an episode and one INFO
    `accept_resumed` ends it, however many retries it took."""

    first: float = 0.01
    cap: float = 1.0
    delay: float = 0.0
    retries: int = 0
    since: float | None = None

    async def wait(self, exc: OSError, connections: int) -> None:
        """Sleep before the next accept after `exc` (an ACCEPT_CAPACITY_ERRNOS failure)."""
        if self.since is None:
            self.since, self.delay, self.retries = trio.current_time(), self.first, 0
            log.warning(
                "accept_paused",
                errno=errno.errorcode.get(exc.errno or 0, str(exc.errno)),
                reason=exc.strerror,
                connections=connections,
                retry_seconds=self.delay,
                max_retry_seconds=self.cap,
            )
        self.retries += 1
        await trio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.cap)

    def accepted(self) -> None:
        """An accept succeeded: end the episode, if one was under way."""
        if self.since is not None:
            paused = trio.current_time() - self.since
            log.info("accept_resumed", paused_seconds=round(paused, 3), retries=self.retries)
            self.since = None


async def _accept(
    server: Server,
    listener: trio.abc.Listener[trio.SocketStream],
    accepting: trio.CancelScope,
    connections: trio.Nursery,
    pause: AcceptPause | None = None,
) -> None:
    """Accept clients until `accepting` is cancelled; their handlers live in `connections`, so they
    finish draining after accepting stops. A shortage of file descriptors or memory pauses accepting
    (`AcceptPause`); any other accept error ends the server."""
    pause = AcceptPause() if pause is None else pause
    with accepting:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                await pause.wait(exc, server.connections)
                continue
            pause.accepted()
            connections.start_soon(server.handle, stream)
    await listener.aclose()


async def _serve_stdio(server: Server, stopped: trio.Event) -> None:
    stdout, stdin = trio.lowlevel.FdStream(os.dup(1)), trio.lowlevel.FdStream(os.dup(0))
    stream = trio.StapledStream(send_stream=stdout, receive_stream=stdin)
    await server.handle(stream)
    stopped.set()


def add_parser(sub: Any) -> None:
    """Add the `serve` subcommand to the CLI's subparsers."""
    parser = sub.add_parser("serve", help="serve the protocol as JSON lines over a Unix socket or stdio")
    parser.add_argument("--db", type=database_arg, required=True, help="SQLite file or postgresql:// URL")
    parser.add_argument(
        "--workflow", type=Path, nargs="+", action="extend", default=[], help="templates to register at start"
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", type=Path, help="Unix domain socket path to listen on")
    where.add_argument("--stdio", action="store_true", help="one client on stdin/stdout")
    defaults = ServeOptions()
    count = _count_arg
    parser.add_argument(
        "--queue-size", type=count, default=defaults.queue_size, help="lines a client may lag"
    )
    parser.add_argument(
        "--queue-bytes", type=count, default=defaults.queue_bytes, help="bytes a client may lag"
    )
    parser.add_argument(
        "--max-line",
        type=_line_arg,
        default=defaults.max_line,
        help=f"bytes in one request line (at most the message limit, {MAX_MESSAGE_BYTES})",
    )
    parser.add_argument("--grace", type=float, default=defaults.grace, help="seconds to read before close")
    parser.add_argument(
        "--max-connections", type=count, default=defaults.max_connections, help="clients served at once"
    )
    parser.add_argument(
        "--idle-timeout",
        type=functools.partial(_seconds_arg, "--idle-timeout"),
        default=defaults.idle_timeout,
        help="seconds a client may stay idle before it is closed (0: never)",
    )
    parser.add_argument(
        "--backlog", type=count, default=defaults.backlog, help="connections queued before accept"
    )
    parser.add_argument(
        "--switch-interval",
        type=functools.partial(_seconds_arg, "--switch-interval"),
        default=SWITCH_INTERVAL,
        help="GIL switch interval in seconds while serving (0: Python's own)",
    )


def _count_arg(text: str) -> int:
    """A count or size option: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _line_arg(text: str) -> int:
    """`--max-line`: a count of at most the protocol's message limit (a longer line would be read only for
    the runtime to refuse it for its size)."""
    value = _count_arg(text)
    if value > MAX_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be at most the message limit {MAX_MESSAGE_BYTES}, not {value}"
        )
    return value


def _seconds_arg(flag: str, text: str) -> float:
    """`--switch-interval`, `--idle-timeout`: seconds, finite and >= 0 (0 has the flag's own meaning)."""
    try:
        return seconds(flag, float(text), allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Run `onceflow serve` from parsed arguments (see `add_parser`). Raises as `serve` does."""
    options = ServeOptions(
        queue_size=args.queue_size,
        queue_bytes=args.queue_bytes,
        max_line=args.max_line,
        grace=args.grace,
        max_connections=args.max_connections,
        idle_timeout=args.idle_timeout,
        backlog=args.backlog,
    )
    return trio.run(
        functools.partial(
            serve,
            args.db,
            args.workflow,
            socket_path=args.socket,
            options=options,
            switch_interval=args.switch_interval or None,
        )
    )
