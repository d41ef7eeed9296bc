"""`onceflow serve`'s server: accepting clients, reading their request lines, applying them in order,
writing replies and events, and shutting down on a signal (the wire contract is onceflow/serve/__init__.py's
docstring). Trio thread: one Trio run owning the runtime and every connection.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
from opentelemetry.trace import TracerProvider

from onceflow.actors.kernel.event_window import DEFAULT_EVENT_WINDOW, EventStream
from onceflow.actors.runtime.host_broker import HostBroker
from onceflow.actors.runtime.startup import SWITCH_INTERVAL, open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.observability.logs import get_logger
from onceflow.protocol.errors import ConflictError, ProtocolError, ShuttingDownError
from onceflow.protocol.event_stream import EventGap, check_after
from onceflow.protocol.events import Reply
from onceflow.serve import hosting
from onceflow.serve.admission import Admission
from onceflow.serve.connection import Connection
from onceflow.serve.descriptors import DEFAULT_MAX_CONNECTIONS, SpareDescriptor, connection_caps
from onceflow.serve.http.app import build_app
from onceflow.serve.http.listen import HttpListener, open_listener
from onceflow.serve.http.options import HttpOptions
from onceflow.serve.options import IdleTimeoutError, ServeOptions, SlowConsumerError
from onceflow.serve.wire import (
    LineReader,
    Overlong,
    Refused,
    error_frame,
    event_frame,
    gap_frame,
    refusal,
    reply_frame,
    split_request,
    unreadable,
)

log = get_logger("onceflow.serve")

ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""accept(2) failures that mean "no file descriptor or memory right now": a waiting client is refused with
the spare descriptor (DESCRIPTOR_ERRNOS), or accepting pauses, then retries."""
WRITE_BATCH_BYTES = 64 * 1024
"""At most this many bytes of queued lines are joined into one write (a longer line goes alone)."""
REPLAY_BATCH = 64
"""Events a replay takes from the window at a time (each then waits for room in the outgoing queue)."""


class Server:
    """Serves one runtime to many connections; see the module docstring for the wire contract. At most
    `options.max_connections` at once (None: DEFAULT_MAX_CONNECTIONS; `serve` sizes it first)."""

    def __init__(
        self,
        runtime: Runtime,
        commands: trio.Nursery,
        options: ServeOptions,
        hosts: HostBroker | None = None,
    ) -> None:
        self._runtime = runtime
        self._commands = commands  # lives until every received command is done; a client never cancels it
        self._options = options
        self._hosts = hosts  # the host role (onceflow/serve/hosting.py); None: register_host is refused
        self._connections: set[Connection] = set()
        self._left = trio.lowlevel.ParkingLot()  # unparked whenever a connection ends
        self._opened = 0
        self._admission = Admission(options.max_connections or DEFAULT_MAX_CONNECTIONS, self._connections)
        self.stopping = False

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._connections)

    def stop(self) -> None:
        """Stop reading every connection but the hosts'; each finishes the commands it received, then closes.
        Host connections are still read for their answers to calls (anything else they send is refused
        `shutting_down`) until `release_hosts`; a call no host holds ends `host_unavailable` at once."""
        self.stopping = True
        if self._hosts is not None:
            self._hosts.stop()
        for conn in self._connections:
            if conn.host is None:
                conn.reading.cancel()
                conn.close_within(self._options.grace)

    async def clients_drained(self) -> None:
        """Wait until every connection that is not a host has ended (after `stop`: its commands answered)."""
        while any(conn.host is None for conn in self._connections):
            await self._left.park()

    def release_hosts(self) -> None:
        """Stop reading the host connections too: the calls they hold end `host_unavailable` at once."""
        for conn in self._connections:
            if conn.host is not None:
                if self._hosts is not None:
                    self._hosts.unregister(conn.host)
                conn.reading.cancel()
                conn.close_within(self._options.grace)

    async def handle(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until it ends (EOF, error, slow consumer, idle, or shutdown), then close
        it; at `max_connections`, evict the longest-idle connection for it or send it the one `busy` line and
        close it (admission.py)."""
        if not await self._admission.enter(stream, stopping=self.stopping):
            return
        conn: Connection | None = None
        out, queued = trio.open_memory_channel[bytes](self._options.queue_size)
        requests, received = trio.open_memory_channel[bytes | Overlong](self._options.max_pipeline)
        worked = trio.Event()
        self._opened += 1
        try:
            async with trio.open_nursery() as nursery:
                conn = Connection(self._opened, stream, nursery, out, queued, self._options)
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
                    if not conn.reading.cancelled_caught:  # end of stream: the client is going away
                        conn.hang_up()
                    requests.close()
                    await worked.wait()  # every received command answered (or its reply dropped)
                    conn.watching.cancel()
                    conn.end_subscription()
                    out.close()  # the writer flushes the queue (and any error line), then stops
                finally:
                    if conn.host is not None and self._hosts is not None:
                        self._hosts.unregister(conn.host)  # the calls it held go to another host
                    self._connections.discard(conn)
                    self._left.unpark_all()
        finally:
            try:
                await trio.aclose_forcefully(stream)
            finally:
                self._admission.leave(conn)  # its descriptor is closed: the slot is free

    async def _read(self, conn: Connection, requests: trio.MemorySendChannel[bytes | Overlong]) -> None:
        lines = LineReader(conn.stream, self._options.max_line, conn.touch)
        while True:
            try:
                line = await lines.receive_line()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if line is None:
                return
            if conn.host is not None and not isinstance(line, Overlong):
                if self._hosts is not None and hosting.MARK in line:
                    frame = hosting.answer(self._hosts, conn, line)
                    if frame is not None:  # answered now, ahead of the pipeline: it may wait on this call
                        conn.push(frame)
                        continue
                if self.stopping and line.strip():
                    conn.push(hosting.stopping(line))
                    continue
            if isinstance(line, Overlong) or line.strip():
                size = 0 if isinstance(line, Overlong) else len(line)
                await conn.admit(size)  # waits while max_line bytes are pending: backpressure
                try:
                    await requests.send(line)  # waits while max_pipeline lines are pending
                except BaseException:  # cancelled (shutdown, slow consumer): the line is never applied
                    conn.answered(size)
                    raise

    async def _work(
        self, conn: Connection, received: trio.MemoryReceiveChannel[bytes | Overlong], worked: trio.Event
    ) -> None:
        """Apply the connection's requests in order; runs in the server's command nursery."""
        try:
            async for line in received:
                conn.push(await self._answer(conn, line))
                conn.answered(0 if isinstance(line, Overlong) else len(line))
        finally:
            worked.set()

    async def _answer(self, conn: Connection, line: bytes | Overlong) -> bytes:
        if isinstance(line, Overlong):
            refused = unreadable(line.head, ProtocolError(f"line longer than {self._options.max_line} bytes"))
            return reply_frame(refused.id, refused.reply)
        request = split_request(line)
        if isinstance(request, Refused):
            return reply_frame(request.id, request.reply)
        kind = request.data.get("type") if isinstance(request.data, dict) else None
        if kind == "subscribe":
            return reply_frame(request.id, self._subscribe(conn, request.data))
        if kind == "register_host":
            return reply_frame(request.id, self._register_host(conn, request.data))
        if kind == "host_reply" and conn.host is None:  # a host's own are answered as they are read
            not_a_host = ProtocolError(
                "host_reply from a connection that is not a host: send register_host first", field="type"
            )
            return reply_frame(request.id, refusal("host_reply", not_a_host))
        if kind == "claim_run":
            return reply_frame(request.id, await self._claim(conn, request.data))
        reply = await self._runtime.send(request.data)  # never raises; the codec's own bounds apply
        return reply_frame(request.id, reply)

    async def _claim(self, conn: Connection, request: dict[str, Any]) -> Reply:
        """A claim_run waits for a run only while its client is connected: once the client closed its side
        it claims nothing (the claim's cancellation hands back a run it committed meanwhile), so no run is
        left claimed by nobody until its lease ends. Answered then as a claim that found no run."""
        scope = conn.claim_wait = trio.CancelScope()
        if conn.hung_up:
            scope.cancel()
        try:
            with scope:
                return await self._runtime.send(request)
        finally:
            conn.claim_wait = None
        return Reply(command="claim_run", ok=True, result=None)

    def _register_host(self, conn: Connection, request: dict[str, Any]) -> Reply:
        if self._hosts is None:
            return refusal("register_host", ProtocolError("this server has no host role", field="type"))
        if self.stopping:
            return refusal("register_host", ShuttingDownError("the server is shutting down"))
        return hosting.register(self._hosts, conn, request)

    def _subscribe(self, conn: Connection, request: dict[str, Any]) -> Reply:
        """Start the connection's event stream: from now on, or replaying from just after `after`."""
        extra = sorted(set(request) - {"type", "after"})
        if extra:
            return refusal("subscribe", ProtocolError(f"{extra[0]}: unknown field", field=extra[0]))
        if conn.subscription is not None:
            return refusal("subscribe", ConflictError("this connection already subscribes"))
        try:
            events = self._runtime.events(check_after(request["after"]) if "after" in request else None)
        except ProtocolError as exc:  # `after` present but not an int64 >= 0 (null included)
            return refusal("subscribe", exc)
        conn.subscription = trio.CancelScope()
        conn.nursery.start_soon(self._pump, conn, conn.subscription, events)
        return Reply(
            command="subscribe", ok=True, result={"subscribed": True, "next_event_seq": events.next_seq}
        )

    async def _pump(self, conn: Connection, scope: trio.CancelScope, events: EventStream) -> None:
        """Write the connection's event lines: the gap line and the replay (with what is published while
        it runs) at the client's pace, then live events as they come, never waiting on the client."""
        with scope:
            if events.gap is not None:
                await conn.push_paced(gap_frame(events.gap))
            while not events.caught_up:
                taken = events.take(REPLAY_BATCH)
                if isinstance(taken, EventGap):
                    conn.fail(_fell_behind(taken))
                    return
                for item in taken:
                    await conn.push_paced(event_frame(item.seq, item.event))
            while await events.wait():
                taken = events.take(sys.maxsize)
                if isinstance(taken, EventGap):
                    conn.fail(_fell_behind(taken))
                    return
                for item in taken:
                    conn.push(event_frame(item.seq, item.event))

    async def _write(self, conn: Connection) -> None:
        """Send the queued lines in order; the lines already queued when the socket is free go in one write
        (up to WRITE_BATCH_BYTES), so a burst costs a few system calls, not one a line."""
        with conn.writing:
            try:
                async for frame in conn.queued:
                    while len(frame) < WRITE_BATCH_BYTES:
                        try:
                            frame += conn.queued.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    await conn.stream.send_all(frame)
                    conn.taken(len(frame))
                    conn.touch()
                if conn.failure is not None:
                    await conn.stream.send_all(error_frame(conn.failure))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away; its commands still run, their replies are dropped
        conn.queued.close()
        if conn.writing.cancelled_caught:
            log.warning("client_not_reading_closed", connection=conn.number, grace_seconds=conn.options.grace)

    async def _watch_idle(self, conn: Connection) -> None:
        """Close the connection once it has been idle (`Connection.busy` false, nothing received) for
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


def _fell_behind(gap: EventGap) -> SlowConsumerError:
    return SlowConsumerError(
        f"the client fell more than the event window behind: events after {gap.after} before {gap.next}"
        " are no longer held"
    )


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
    event_window: int = DEFAULT_EVENT_WINDOW,
    http: HttpOptions | None = None,
) -> int:
    """Serve the runtime on `db` over `socket_path`, or over stdin/stdout when it is None and `http` is
    None too (the one connection's end then ends the server), and over HTTP when `http` is given
    (onceflow/serve/http/), until SIGTERM/SIGINT. Returns the exit status: 0 after a
    clean shutdown, 1 if a workflow is refused. `switch_interval`: the GIL switch interval in seconds while
    serving (`open_runtime`; the process is the server's own), None for Python's. `tracer_provider`: where
    the runtime's spans go (None: the global one, e.g. as `opentelemetry-instrument` sets it); a request's
    `traceparent` is its command span's parent (onceflow/observability/tracing.py). `event_window`: how many
    of the latest events the runtime keeps for subscribers resuming with `after` (`open_runtime`'s).

    Raises DatabaseOwnedError (another runtime owns `db`), OSError (the socket or the HTTP address cannot
    be bound; a workflow file cannot be read).
    """
    hosts = HostBroker(host_timeout=options.host_timeout, host_wait=options.host_wait)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:  # queued until watched
        listener = None if socket_path is None else await _bind(socket_path, options.backlog)
        web = None if http is None else await open_listener(http, options.backlog)
        try:
            # Opened outside any nursery, so its errors surface as themselves, not in an ExceptionGroup.
            async with open_runtime(
                db,
                host=hosts,
                switch_interval=switch_interval,
                tracer_provider=tracer_provider,
                event_window=event_window,
            ) as runtime:
                hosts.on_coordinator = runtime.attach_coordinator
                hosts.clock = runtime.services.clock  # call records share the runtime's time base
                if listener is not None or web is not None:  # one descriptor budget for both listeners
                    caps = connection_caps(
                        options.max_connections,
                        None if http is None else http.max_connections,
                        serving_socket=listener is not None,
                        serving_http=web is not None,
                    )
                    options = attrs.evolve(options, max_connections=caps[0] or options.max_connections)
                    if http is not None:
                        http = attrs.evolve(http, max_connections=caps[1])
                if not await _register(runtime, workflows):
                    return 1
                async with trio.open_nursery() as recording:  # ended calls' records, written to the last
                    await recording.start(hosts.record_forever, runtime.services.store, runtime.hub)
                    try:
                        async with trio.open_nursery() as everything:
                            stopped = trio.Event()
                            everything.start_soon(_watch_signals, signals, stopped, everything.cancel_scope)
                            await _serve(runtime, hosts, listener, socket_path, options, stopped, web, http)
                            everything.cancel_scope.cancel()  # the signal watcher
                    finally:
                        hosts.close()
        finally:
            if web is not None:
                await web.aclose()
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
    hosts: HostBroker,
    listener: trio.SocketListener | None,
    socket_path: Path | None,
    options: ServeOptions,
    stopped: trio.Event,
    web: trio.SocketListener | None = None,
    http: HttpOptions | None = None,
) -> None:
    """Serve until `stopped`, then drain: returns once every received command is done and answered (host
    connections answer calls until the other clients are done; HTTP requests finish theirs and event
    streams end). Over stdio the one client, whose end ends the server, is never timed out."""
    stdio = listener is None and web is None
    if stdio:
        options = attrs.evolve(options, idle_timeout=0.0)
    async with trio.open_nursery() as commands:
        server = Server(runtime, commands, options, hosts)
        async with trio.open_nursery() as connections:
            accepting = trio.CancelScope()
            site = None
            if web is not None and http is not None:
                site = await connections.start(_serve_http, runtime, commands, web, http, options, stopped)
            if stdio:
                connections.start_soon(_serve_stdio, server, stopped)
            elif listener is not None:
                connections.start_soon(accept_clients, server, listener, accepting, connections)
            if socket_path is not None or stdio:
                print(f"serving on {socket_path or 'stdio'}", file=sys.stderr, flush=True)
            await stopped.wait()
            if site is not None:
                site.stop()
            server.stop()
            accepting.cancel()
            await server.clients_drained()
            server.release_hosts()


@attrs.define
class AcceptPause:
    """How accepting waits out a shortage of memory (ENOBUFS, ENOMEM), or of file descriptors when the spare
    cannot answer it (`SpareDescriptor`): `first` seconds, doubling up to `cap`, until an accept succeeds.
    One WARNING `accept_paused` starts an episode and one INFO `accept_resumed` ends it, however many
    retries it took."""

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


async def accept_clients(
    server: Server,
    listener: trio.abc.Listener[trio.SocketStream],
    accepting: trio.CancelScope,
    connections: trio.Nursery,
    pause: AcceptPause | None = None,
) -> None:
    """Accept clients until `accepting` is cancelled; their handlers live in `connections`, so they
    finish draining after accepting stops. For want of a file descriptor the waiting client is told `busy`
    (`SpareDescriptor`); a shortage of memory, or of descriptors the spare cannot answer, pauses accepting
    (`AcceptPause`); any other accept error ends the server."""
    pause = AcceptPause() if pause is None else pause
    with accepting, SpareDescriptor() as spare:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                try:
                    waiting = await spare.accept_waiting(listener, exc, server.connections)
                except OSError as short:
                    if short.errno not in ACCEPT_CAPACITY_ERRNOS:
                        raise
                    await pause.wait(short, server.connections)
                    spare.restore()
                    continue
                if waiting is None:
                    continue  # refused with `busy`
                stream = waiting
            pause.accepted()
            spare.accepted()
            connections.start_soon(server.handle, stream)
    await listener.aclose()


async def _serve_http(
    runtime: Runtime,
    commands: trio.Nursery,
    web: trio.SocketListener,
    http: HttpOptions,
    options: ServeOptions,
    stopped: trio.Event,
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP on `web` until `stopped` (then the listener drains, onceflow/serve/http/listen.py); its
    connections have a cap of their own (`http.max_connections`, set with the socket's from one descriptor
    budget: descriptors.connection_caps)."""
    app = build_app(runtime, commands, http, stopped, options.grace)
    cap = http.max_connections or options.max_connections or DEFAULT_MAX_CONNECTIONS
    site = HttpListener(app, http, cap, options.grace)
    host, port = web.socket.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving on http://{shown}:{port}", file=sys.stderr, flush=True)
    task_status.started(site)
    await site.run(web)


async def _serve_stdio(server: Server, stopped: trio.Event) -> None:
    stdout, stdin = trio.lowlevel.FdStream(os.dup(1)), trio.lowlevel.FdStream(os.dup(0))
    stream = trio.StapledStream(send_stream=stdout, receive_stream=stdin)
    await server.handle(stream)
    stopped.set()
