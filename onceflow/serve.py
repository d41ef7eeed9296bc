"""`onceflow serve`: the protocol as JSON lines over a Unix domain socket or stdin/stdout. Trio thread: one
Trio run owning the runtime and every connection.

Wire format (one JSON object per line, UTF-8, `\\n`-terminated; a blank line is ignored):

- Request: any command object, optionally with an `"id"` (a string of at most 256 characters, or an
  integer in the int64 range) that the reply echoes; the `id` is removed before the command is decoded.
  `{"type": "subscribe"}` asks for the event stream on this connection.
- Reply to a request: `{"id": <id or null>, "reply": <Reply>}`, the same `Reply` model `Runtime.send`
  returns in process. A line that is not JSON, names an unknown command, has a bad field or a bad `id`
  gets an `invalid_message` reply (`id` null when it could not be read) and the connection stays open.
  A line longer than `max_line` bytes (1 MiB by default) gets the same error and is skipped up to its
  newline.
- Event (after `subscribe`): `{"event": <Event>}`, every event the runtime emits from then on.
- Connection error, the last line before the server closes the connection: `{"error": <ErrorInfo>}`;
  `slow_consumer` when the client stopped reading and its outgoing queue filled.

A connection's commands are applied one at a time in the order received (as a host awaiting each
`Runtime.send` in turn would), and replied to in that order; for parallelism open more connections. Up
to `max_pipeline` received lines wait their turn; past that the server stops reading that connection
(the socket's own flow control), and no other client is slowed. Each connection's commands run in a
task of the server's, never cancelled by the client going away: a client that disconnects mid-command
loses nothing that committed — what it had sent still runs and commits; the replies are dropped.

Backpressure: replies and events for a connection go through a bounded queue (`queue_size` lines). A
client that stops reading fills it; then it is sent the `slow_consumer` error line after what is queued
(if it reads within `grace` seconds) and disconnected. Nothing the runtime does ever waits on a client.

SIGTERM or SIGINT: stop accepting and reading, let every received command finish and its reply be
written (clients get `grace` seconds to read them), close the store, remove the socket file, exit 0. A
second signal cancels what is left (the store still finishes or rolls back each transaction whole).
At start, after the workflows are registered, one line `serving on PATH` (or `serving on stdio`) goes to
stderr. The socket file is created with mode 0600 (owner only); a stale socket file is replaced, a live
one (another server answers) is an error.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from onceflow.actors.runtime.startup import SWITCH_INTERVAL, open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.logs import get_logger
from onceflow.protocol.codec import encode
from onceflow.protocol.durations import seconds
from onceflow.protocol.errors import OnceflowError, ProtocolError
from onceflow.protocol.events import ErrorInfo, Event, Reply
from onceflow.store.urls import database_arg

log = get_logger("onceflow.serve")

MAX_ID_LENGTH = 256
INT64 = range(-(2**63), 2**63)


class SlowConsumerError(OnceflowError):
    """The client stopped reading and its outgoing queue filled; the server disconnects it."""

    code = "slow_consumer"


@attrs.frozen
class ServeOptions:
    """Per-connection bounds. `queue_size`: outgoing lines (replies and events) a client may lag behind;
    `max_line`: bytes in one request line; `max_pipeline`: received lines waiting to be applied;
    `grace`: seconds a disconnecting client (slow, or at shutdown) gets to read what is queued."""

    queue_size: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    max_line: int = attrs.field(default=1 << 20, validator=attrs.validators.ge(1))
    max_pipeline: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    grace: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))


class _Overlong:
    """Stands for a request line longer than `max_line` (already skipped)."""


OVERLONG = _Overlong()


class _LineReader:
    """Splits a byte stream into lines of at most `max_line` bytes; longer lines become OVERLONG."""

    def __init__(self, stream: trio.abc.ReceiveStream, max_line: int) -> None:
        self._stream, self._max = stream, max_line
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline
        self._skipping = False  # inside an overlong line, dropping bytes up to its newline

    async def receive_line(self) -> bytes | _Overlong | None:
        """The next line without its newline, OVERLONG once per overlong line, None at end of stream.

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
                return OVERLONG if len(line) > self._max else line
            self._scanned = len(self._buffer)
            if self._scanned > self._max:
                self._buffer.clear()
                self._scanned = 0
                if not self._skipping:
                    self._skipping = True
                    return OVERLONG
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                tail, self._buffer = bytes(self._buffer), bytearray()
                if tail and not self._skipping:
                    return OVERLONG if len(tail) > self._max else tail  # a last line without newline
                return None
            self._buffer += chunk


def reply_frame(request_id: str | int | None, reply: Reply) -> bytes:
    """The reply line: `{"id": ..., "reply": {...}}` plus newline."""
    return f'{{"id":{json.dumps(request_id)},"reply":{encode(reply)}}}\n'.encode()


def event_frame(event: Event) -> bytes:
    """The event line: `{"event": {...}}` plus newline."""
    return f'{{"event":{encode(event)}}}\n'.encode()


def error_frame(error: ErrorInfo) -> bytes:
    """The connection's last line: `{"error": {"code", "message", "field"}}` plus newline."""
    return f'{{"error":{encode(error)}}}\n'.encode()


def _refusal(command: str, exc: OnceflowError) -> Reply:
    return Reply(
        command=command, ok=False, error=ErrorInfo(code=exc.code, message=exc.message, field=exc.field)
    )


@attrs.frozen
class Request:
    """One request line read: its `id`, its JSON value without the `id`, and the line `Runtime.send`
    gets (the line itself, or the value re-encoded when an `id` was removed)."""

    id: str | int | None
    data: Any
    line: bytes | str


def split_request(line: bytes) -> Request | Reply:
    """Read a request line; an `invalid_message` Reply when it is not JSON or its `id` is unacceptable."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8; nesting past the parser's depth
        return _refusal("unknown", ProtocolError(f"not valid JSON: {exc}"))
    if not isinstance(data, dict) or "id" not in data:
        return Request(None, data, line)
    request_id = data.pop("id")
    if (
        request_id is None
        or (isinstance(request_id, str) and len(request_id) <= MAX_ID_LENGTH)
        or (type(request_id) is int and request_id in INT64)
    ):
        return Request(request_id, data, json.dumps(data))
    kind = data["type"] if isinstance(data.get("type"), str) else "unknown"
    error = ProtocolError(
        f"id must be a string of at most {MAX_ID_LENGTH} characters or a 64-bit integer", field="id"
    )
    return _refusal(kind, error)


@attrs.define(eq=False)
class _Connection:
    """One client: its stream, its bounded outgoing queue, and the scopes that stop it."""

    number: int  # the n-th connection since start, for the logs
    stream: trio.abc.Stream
    nursery: trio.Nursery
    out: trio.MemorySendChannel[bytes]
    queued: trio.MemoryReceiveChannel[bytes]
    grace: float
    reading: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    writing: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    subscription: trio.CancelScope | None = None
    failure: ErrorInfo | None = None

    def push(self, frame: bytes) -> None:
        """Queue a line for the client without ever waiting; a full queue disconnects the client."""
        if self.failure is not None:
            return
        try:
            self.out.send_nowait(frame)
        except trio.WouldBlock:
            self.fail(SlowConsumerError("the client stopped reading and its outgoing queue is full"))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client is gone or the connection is closing: the line has nowhere to go

    def fail(self, exc: OnceflowError) -> None:
        """Disconnect: read nothing more, send nothing new, flush what is queued plus the error line."""
        self.failure = ErrorInfo(code=exc.code, message=exc.message, field=exc.field)
        log.warning("client_disconnected", connection=self.number, code=exc.code, reason=exc.message)
        self.reading.cancel()
        self.end_subscription()
        self.close_within(self.grace)

    def end_subscription(self) -> None:
        if self.subscription is not None:
            self.subscription.cancel()

    def close_within(self, seconds: float) -> None:
        self.writing.deadline = min(self.writing.deadline, trio.current_time() + seconds)


class Server:
    """Serves one runtime to many connections; see the module docstring for the wire contract."""

    def __init__(self, runtime: Runtime, commands: trio.Nursery, options: ServeOptions) -> None:
        self._runtime = runtime
        self._commands = commands  # lives until every received command is done; a client never cancels it
        self._options = options
        self._connections: set[_Connection] = set()
        self._opened = 0
        self.stopping = False

    def stop(self) -> None:
        """Stop reading every connection; each finishes the commands it received, then closes."""
        self.stopping = True
        for conn in self._connections:
            conn.reading.cancel()
            conn.close_within(self._options.grace)

    async def handle(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until it ends (EOF, error, slow consumer or shutdown), then close it."""
        out, queued = trio.open_memory_channel[bytes](self._options.queue_size)
        requests, received = trio.open_memory_channel[bytes | _Overlong](self._options.max_pipeline)
        worked = trio.Event()
        self._opened += 1
        try:
            async with trio.open_nursery() as nursery:
                conn = _Connection(self._opened, stream, nursery, out, queued, self._options.grace)
                self._connections.add(conn)
                try:
                    if self.stopping:
                        conn.reading.cancel()
                    nursery.start_soon(self._write, conn)
                    self._commands.start_soon(self._work, conn, received, worked)
                    with conn.reading:
                        await self._read(conn, requests)
                    requests.close()
                    await worked.wait()  # every received command answered (or its reply dropped)
                    conn.end_subscription()
                    out.close()  # the writer flushes the queue (and any error line), then stops
                finally:
                    self._connections.discard(conn)
        finally:
            await trio.aclose_forcefully(stream)

    async def _read(self, conn: _Connection, requests: trio.MemorySendChannel[bytes | _Overlong]) -> None:
        lines = _LineReader(conn.stream, self._options.max_line)
        while True:
            try:
                line = await lines.receive_line()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if line is None:
                return
            if isinstance(line, _Overlong) or line.strip():
                await requests.send(line)  # waits while max_pipeline lines are pending: backpressure

    async def _work(
        self, conn: _Connection, received: trio.MemoryReceiveChannel[bytes | _Overlong], worked: trio.Event
    ) -> None:
        """Apply the connection's requests in order; runs in the server's command nursery."""
        try:
            async for line in received:
                conn.push(await self._answer(conn, line))
        finally:
            worked.set()

    async def _answer(self, conn: _Connection, line: bytes | _Overlong) -> bytes:
        if isinstance(line, _Overlong):
            limit = self._options.max_line
            return reply_frame(None, _refusal("unknown", ProtocolError(f"line longer than {limit} bytes")))
        request = split_request(line)
        if isinstance(request, Reply):
            return reply_frame(None, request)
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
                if conn.failure is not None:
                    await conn.stream.send_all(error_frame(conn.failure))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away; its commands still run, their replies are dropped
        conn.queued.close()
        if conn.writing.cancelled_caught:
            log.warning("client_not_reading_closed", connection=conn.number, grace_seconds=conn.grace)


async def _bind(path: Path) -> trio.SocketListener:
    """Listen on `path` (mode 0600), replacing a stale socket file. Raises OSError if another server
    answers there, if `path` is some other file, or if it cannot be bound (e.g. longer than ~107 bytes)."""
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
    sock.listen(128)
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
) -> int:
    """Serve the runtime on `db` over `socket_path`, or over stdin/stdout when it is None (the one
    connection's end then ends the server), until SIGTERM/SIGINT. Returns the exit status: 0 after a
    clean shutdown, 1 if a workflow is refused. `switch_interval`: the GIL switch interval in seconds while
    serving (`open_runtime`; the process is the server's own), None for Python's.

    Raises DatabaseOwnedError (another runtime owns `db`), OSError (the socket cannot be bound; a
    workflow file cannot be read).
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:  # queued until watched
        listener = None if socket_path is None else await _bind(socket_path)
        try:
            # Opened outside any nursery, so its errors surface as themselves, not in an ExceptionGroup.
            async with open_runtime(db, switch_interval=switch_interval) as runtime:
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
    """Serve until `stopped`, then drain: returns once every received command is done and answered."""
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


async def _accept(
    server: Server, listener: trio.SocketListener, accepting: trio.CancelScope, connections: trio.Nursery
) -> None:
    """Accept clients until `accepting` is cancelled; their handlers live in `connections`, so they
    finish draining after accepting stops."""
    with accepting:
        await trio.serve_listeners(server.handle, [listener], handler_nursery=connections)
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
    parser.add_argument("--queue-size", type=int, default=defaults.queue_size, help="lines a client may lag")
    parser.add_argument("--max-line", type=int, default=defaults.max_line, help="bytes in one request line")
    parser.add_argument("--grace", type=float, default=defaults.grace, help="seconds to read before close")
    parser.add_argument(
        "--switch-interval",
        type=_interval_arg,
        default=SWITCH_INTERVAL,
        help="GIL switch interval in seconds while serving (0: Python's own)",
    )


def _interval_arg(text: str) -> float:
    """`--switch-interval`: seconds, finite and >= 0 (0: Python's own interval)."""
    try:
        return seconds("--switch-interval", float(text), allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Run `onceflow serve` from parsed arguments (see `add_parser`). Raises as `serve` does."""
    options = ServeOptions(queue_size=args.queue_size, max_line=args.max_line, grace=args.grace)
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
