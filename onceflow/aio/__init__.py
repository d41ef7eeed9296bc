"""Embedding under asyncio: the Trio runtime on its own thread, driven from an asyncio loop.

    async with onceflow.aio.open_runtime(db_path, host=...) as rt:
        reply = await rt.send({"type": "get_task", "task_id": "T-1"})
        async with rt.subscribe() as events:
            async for event in events: ...
        async with rt.events(after=last_seq) as events:  # with event_seqs, resuming (EventGap where gone)
            async for item in events: ...

`open_runtime` starts one thread running `trio.run`; calls go in through the Trio token
(`TrioToken.run_sync_soon`, first in first out) and answers come back through
`loop.call_soon_threadsafe`, so the asyncio loop never blocks on the runtime and the runtime never
waits on asyncio. The coroutine methods of a `Host` or `Coordinator` passed in run on the caller's asyncio
loop (onceflow/aio/hosts.py), unless `host_loop="trio"` says they are Trio code. The
OpenTelemetry context current where `send` is called goes with the command: the caller's span is the
parent of the command's span.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

import trio
from opentelemetry.context import Context
from opentelemetry.trace import TracerProvider
from pydantic import BaseModel

import onceflow.actors.runtime.startup as startup
import onceflow.actors.runtime.supervisor as supervisor
from onceflow.actors.kernel import task_rows
from onceflow.actors.kernel.event_window import DEFAULT_EVENT_WINDOW, EventStream
from onceflow.actors.runtime.epoch_sweep import SWEEP_INTERVAL
from onceflow.actors.runtime.retention import RETENTION_EVERY
from onceflow.actors.runtime.runs import LEASE_SWEEP_INTERVAL
from onceflow.aio.hosts import COORDINATOR_METHODS, HOST_METHODS, AsyncioCalls
from onceflow.aio.hosts import HostCallCancelledError as HostCallCancelledError  # re-exported
from onceflow.aio.worker import AsyncioRun, AsyncioRuns
from onceflow.observability import tracing
from onceflow.protocol import commands as c
from onceflow.protocol.codec import command_type, parse_json
from onceflow.protocol.coordinator import Coordinator, RetryPolicy
from onceflow.protocol.errors import OnceflowError
from onceflow.protocol.event_stream import EventGap, SequencedEvent, check_after
from onceflow.protocol.events import ErrorInfo, Event, Reply
from onceflow.protocol.host import Host
from onceflow.protocol.runs import DEFAULT_RETENTION, RunPolicy
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, Executor
from onceflow.store.writer import DEFAULT_BUSY_TIMEOUT, Durability

T = TypeVar("T")

EVENT_BATCH = 256
"""Items an `EventSubscription` asks the Trio thread for at a time (its buffer's bound)."""

__all__ = [
    "AsyncioRun",
    "AsyncioRuns",
    "AsyncioRuntime",
    "EventSubscription",
    "HostCallCancelledError",
    "Subscription",
    "open_runtime",
]


class _End:
    """Marks the end of a subscription's stream."""


_END = _End()


class Subscription:
    """Events emitted from `subscribe()` on, as an async iterator (unbounded, like the Trio stream).

    The stream ends when the runtime closes; `aclose()` (or leaving `async with`) ends it earlier.
    """

    def __init__(self, owner: AsyncioRuntime) -> None:
        self._owner = owner
        self._queue: asyncio.Queue[Event | _End] = asyncio.Queue()
        self._scope: trio.CancelScope | None = None  # Trio thread only
        self._ended = False

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, _End):
            self._ended = True
            raise StopAsyncIteration
        return item

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop receiving; events already queued are dropped."""
        self._ended = True
        self._owner._call_in_trio(self._cancel)

    def _cancel(self) -> None:  # Trio thread; runs after _start (the token's queue is FIFO)
        if self._scope is not None:
            self._scope.cancel()

    def _put(self, item: Event | _End) -> None:  # Trio thread
        self._owner._call_in_asyncio(self._queue.put_nowait, item)


class EventSubscription:
    """`Runtime.events(after=...)` for asyncio: `SequencedEvent`s and `EventGap`s as the Trio API yields
    them. Pulled: when its buffer is empty the iterator asks the Trio thread for up to `EVENT_BATCH` items,
    so nothing queues beyond one batch however slowly it is read (a reader more than `event_window` events
    behind gets an `EventGap`, as in Trio). A cancelled `__anext__` loses nothing: the batch it asked for
    lands in the buffer for the next call. Ends when the runtime closes (after what was published before)
    or at `aclose()`.
    """

    def __init__(self, owner: AsyncioRuntime) -> None:
        self._owner = owner
        self._items: collections.deque[SequencedEvent | EventGap] = collections.deque()
        self._arrived = asyncio.Event()
        self._asking = False
        self._ended = False  # no more items will come (asyncio thread)
        self._stream: EventStream | None = None  # the rest: Trio thread only
        self._scope: trio.CancelScope | None = None  # the pull under way
        self._closed = False

    def __aiter__(self) -> EventSubscription:
        return self

    async def __anext__(self) -> SequencedEvent | EventGap:
        while not self._items:
            if self._ended:
                raise StopAsyncIteration
            if not self._asking:
                self._asking = True
                self._arrived.clear()
                if not self._owner._call_in_trio(self._owner._pull_events, self):
                    self._ended = True
                    continue
            await self._arrived.wait()
        return self._items.popleft()

    async def __aenter__(self) -> EventSubscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop receiving; items already buffered are dropped."""
        self._ended = True
        self._items.clear()
        self._owner._call_in_trio(self._finish)

    def _deliver(self, items: list[SequencedEvent | EventGap], end: bool) -> None:  # asyncio thread
        if not self._ended:
            self._items.extend(items)
            self._ended = end
        self._asking = False
        self._arrived.set()

    def _finish(self) -> None:  # Trio thread: no more pulls; one under way delivers what is held and ends
        self._closed = True
        if self._scope is not None:
            self._scope.cancel()
        elif self._stream is not None:
            self._owner._call_in_asyncio(self._deliver, self._stream.batch(sys.maxsize), True)


class AsyncioRuntime:
    """The asyncio face of a `Runtime` running on its own Trio thread (made by `open_runtime`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._host_calls = AsyncioCalls(loop)
        self._token: trio.lowlevel.TrioToken | None = None
        self._runtime: supervisor.Runtime | None = None  # the rest: Trio thread only
        self._commands: trio.Nursery | None = None
        self._pumps: trio.Nursery | None = None
        self._subscriptions: set[Subscription] = set()
        self._event_subscriptions: set[EventSubscription] = set()
        self._stop = trio.Event()
        self._accepting = False
        self._pending: set[asyncio.Future[Reply]] = set()  # asyncio thread only
        self.ready: asyncio.Future[None] = loop.create_future()
        self.finished: asyncio.Future[None] = loop.create_future()

    def send(self, command: c.Command | BaseModel | dict[str, Any] | str | bytes) -> asyncio.Future[Reply]:
        """Submit one command now and return a future of its `Reply` (as `Runtime.send`, never an error).

        The command is handed to the runtime when `send` is called, not when the future is awaited.
        Commands awaited one after another apply in that order; commands in flight together (e.g. under
        `asyncio.gather`) may apply in any order, as concurrent sends do under Trio.
        Cancelling the future (e.g. by `asyncio.wait_for`) only stops the wait: the command runs to
        completion on the Trio thread, so what it commits stays committed and nothing is half-applied
        (each of its transactions commits whole or not at all); its reply is dropped. After the runtime
        has closed the reply is `shutting_down`.
        """
        future: asyncio.Future[Reply] = self._loop.create_future()
        self._pending.add(future)
        context = (
            tracing.current()
        )  # the caller's span is the command span's parent (onceflow/observability/tracing.py)
        if not self._call_in_trio(self._start_command, command, future, context):
            self._answer(future, _shutting_down(command))
        return future

    def subscribe(self) -> Subscription:
        """A stream of every event emitted from now on (the Trio API's `subscribe`), for `async for`."""
        subscription = Subscription(self)
        if not self._call_in_trio(self._start_subscription, subscription):
            subscription._queue.put_nowait(_END)
        return subscription

    def events(self, after: int | None = None) -> EventSubscription:
        """The events with their event_seqs from just after `after` (None: from now on), for `async for`:
        `Runtime.events` on this loop (replay of what is held, `EventGap` where events are gone).

        Raises:
            ProtocolError: `after` is not an integer in 0..2**63-1 (field `after`).
        """
        if after is not None:
            after = check_after(after)
        subscription = EventSubscription(self)
        if not self._call_in_trio(self._start_events, subscription, after):
            subscription._ended = True
        return subscription

    def runs(
        self,
        agent_profile_id: str | Sequence[str] | None,
        *,
        lease_seconds: float | None = None,
        wait_seconds: float = 60.0,
        until_idle: bool = False,
        cancel_superseded: bool = True,
    ) -> AsyncioRuns:
        """A worker over the runs queue for one agent profile, for `async with` / `async for` /
        `async with run` on this loop (onceflow/aio/worker.py; the options and rules are `Runtime.runs`'s).

        Raises:
            ProtocolError: a bad option, naming the field.
            ShuttingDownError: the runtime is not open.
        """
        return AsyncioRuns(
            self,
            agent_profile_id,
            lease_seconds=lease_seconds,
            wait_seconds=wait_seconds,
            until_idle=until_idle,
            cancel_superseded=cancel_superseded,
        )

    # Trio thread ------------------------------------------------------------------------------

    async def _serve(self, db_path: str | os.PathLike[str], options: dict[str, Any]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with startup.open_runtime(db_path, **options) as runtime:
            try:
                async with trio.open_nursery() as pumps:
                    async with trio.open_nursery() as commands:
                        self._runtime, self._commands, self._pumps = runtime, commands, pumps
                        self._accepting = True
                        self._call_in_asyncio(_settle, self.ready, None)
                        await self._stop.wait()
                        self._accepting = False  # commands already submitted are running; none start now
                    for subscription in self._subscriptions:  # after the last command's events
                        subscription._cancel()
                    for events in self._event_subscriptions:
                        events._finish()
            finally:
                self._accepting = False

    def _close(self) -> None:
        """Stop taking commands and give up every asyncio host call, pending or later: the commands
        already submitted drain without waiting on asyncio code."""
        self._host_calls.close()
        self._stop.set()

    def _start_command(self, command: Any, future: asyncio.Future[Reply], context: Context) -> None:
        if not self._accepting or self._commands is None:
            self._call_in_asyncio(self._answer, future, _shutting_down(command))
            return
        self._commands.start_soon(self._run_command, command, future, context)

    async def _run_command(self, command: Any, future: asyncio.Future[Reply], context: Context) -> None:
        assert self._runtime is not None
        try:
            with tracing.attached(context):
                reply = await self._runtime.send(command)
        except Exception as exc:  # Runtime.send never raises; if it ever does, the caller still hears
            reply = Reply(command="unknown", ok=False, error=ErrorInfo(code="internal", message=repr(exc)))
        self._call_in_asyncio(self._answer, future, reply)

    def _start_subscription(self, subscription: Subscription) -> None:
        if not self._accepting or self._runtime is None or self._pumps is None:
            subscription._put(_END)
            return
        subscription._scope = trio.CancelScope()
        self._subscriptions.add(subscription)
        self._pumps.start_soon(self._pump, subscription, self._runtime.subscribe())

    async def _pump(self, subscription: Subscription, events: trio.MemoryReceiveChannel[Event]) -> None:
        assert subscription._scope is not None
        with events:
            with subscription._scope:
                async for event in events:
                    subscription._put(event)
            while not subscription._ended:  # at shutdown: what was already emitted still goes out
                try:
                    subscription._put(events.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
        self._subscriptions.discard(subscription)
        subscription._put(_END)

    def _start_events(self, subscription: EventSubscription, after: int | None) -> None:
        if not self._accepting or self._runtime is None:
            self._call_in_asyncio(subscription._deliver, [], True)
            return
        subscription._stream = self._runtime.events(after)  # the position is taken here, at once
        self._event_subscriptions.add(subscription)

    def _pull_events(self, subscription: EventSubscription) -> None:
        stream = subscription._stream
        if subscription._closed or stream is None or self._pumps is None:
            rest = [] if stream is None else stream.batch(sys.maxsize)
            self._call_in_asyncio(subscription._deliver, rest, True)
            return
        subscription._scope = trio.CancelScope()
        self._pumps.start_soon(self._pull, subscription, stream, subscription._scope)

    async def _pull(
        self, subscription: EventSubscription, stream: EventStream, scope: trio.CancelScope
    ) -> None:
        items: list[SequencedEvent | EventGap] = []
        with scope:
            items = await stream.next_batch(EVENT_BATCH)
        subscription._scope = None
        end = scope.cancelled_caught or not items  # closed: what is held goes out with the end
        if scope.cancelled_caught:
            items += stream.batch(sys.maxsize)
        if end:
            self._event_subscriptions.discard(subscription)
        self._call_in_asyncio(subscription._deliver, items, end)

    # Crossing threads -------------------------------------------------------------------------

    def _call_in_trio(self, function: Callable[..., None], *args: Any) -> bool:
        """Run `function(*args)` on the Trio thread soon; False if the runtime's thread has finished."""
        assert self._token is not None
        try:
            self._token.run_sync_soon(function, *args)
        except trio.RunFinishedError:
            return False
        return True

    def _call_in_asyncio(self, function: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(function, *args)

    def _answer(self, future: asyncio.Future[Reply], reply: Reply) -> None:  # asyncio thread
        self._pending.discard(future)
        _settle(future, reply)

    def _abandon_pending(self) -> None:  # asyncio thread, once the Trio thread has finished
        for future in list(self._pending):
            self._answer(future, _shutting_down())

    def _thread(self, db_path: str | os.PathLike[str], options: dict[str, Any]) -> None:
        try:
            trio.run(self._serve, db_path, options)
        except BaseException as exc:
            opened = self._runtime is not None
            self._call_in_asyncio(_settle, self.finished if opened else self.ready, None, exc)
        self._call_in_asyncio(self._abandon_pending)
        self._call_in_asyncio(_settle, self.finished, None)


def _settle(future: asyncio.Future[T], result: T, error: BaseException | None = None) -> None:
    if future.done():  # a cancelled wait, or already settled
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _shutting_down(command: Any = None) -> Reply:
    """The `shutting_down` reply to `command`, naming its type when it has one (`unknown` otherwise, or
    for a pending reply whose command is no longer known)."""
    error = ErrorInfo(code="shutting_down", message="the runtime is shutting down")
    return Reply(command=_type_of(command), ok=False, error=error)


def _type_of(command: Any) -> str:
    """A command's `type`: a model's own, else what `command_type` reads from a mapping or a JSON line."""
    if c.is_command(command):
        return str(getattr(command, "type", "unknown"))
    if isinstance(command, str | bytes):
        try:
            command = parse_json(command)
        except OnceflowError:
            return "unknown"
    return command_type(command)


async def _wait_through_cancellation(future: asyncio.Future[T]) -> T:
    """Await `future` to the end even if the caller is cancelled meanwhile, then re-raise the cancel."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return future.result()


@asynccontextmanager
async def open_runtime(
    db_path: str | os.PathLike[str],
    *,
    host_loop: Literal["asyncio", "trio"] = "asyncio",
    host: Host | None = None,
    durability: Durability = Durability.FULL,
    max_batch: int = 64,
    clock: Callable[[], float] = time.time,
    executors: Mapping[str, Executor] = DEFAULT_EXECUTORS,
    coordinator: Coordinator | None = None,
    redelivery_interval: float = 60.0,
    retry_policy: RetryPolicy | None = None,
    actor_idle_timeout: float = 0.0,
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    epoch_sweep_interval: float = SWEEP_INTERVAL,
    task_row_cache: int = task_rows.DEFAULT_CAPACITY,
    switch_interval: float | None = None,
    run_policy: RunPolicy | None = None,
    lease_sweep_interval: float = LEASE_SWEEP_INTERVAL,
    retention: float = DEFAULT_RETENTION,
    retention_every: int = RETENTION_EVERY,
    tracer_provider: TracerProvider | None = None,
    event_window: int = DEFAULT_EVENT_WINDOW,
) -> AsyncIterator[AsyncioRuntime]:
    """Open a runtime for an asyncio program: `async with open_runtime(db) as rt` under `asyncio.run`.

    Every keyword but `host_loop` is `onceflow.open_runtime`'s, with the same default and meaning (its
    docstring says each: `host`, `durability`, `coordinator`, `retention` in seconds, ...); a test keeps the
    two signatures equal. Entering waits for the runtime to be open (store, recovery scan) and raises what
    opening raised, as itself: `DatabaseOwnedError` when another runtime owns the file, ValueError for a bad
    option. Leaving stops taking commands, lets the ones submitted finish, ends every subscription, closes
    the store and joins the thread — even when the leaving task is cancelled (the cancellation is re-raised
    after). An error that stopped the runtime while open is raised on leaving.

    `host_loop` says where the coroutine methods of `host` and `coordinator` run. "asyncio" (default): as
    tasks on this loop, awaited by the runtime across threads (onceflow/aio/hosts.py), so they may await
    any asyncio code; a method that is not a coroutine function, and `BaseHost`'s own no-ops, are still
    called on the Trio thread. A call the runtime gives up on is cancelled on this loop (the coroutine
    sees CancelledError): at a coordinator attempt's timeout, and for every call pending or started once
    leaving begins (it fails as `HostCallCancelledError`, reported like any raising host call; leaving
    never waits on host code). "trio": every method is Trio code on the runtime's thread, as under
    `trio.run`.

    Raises:
        ValueError: `host_loop` is neither "asyncio" nor "trio" (before anything is opened).
    """
    if host_loop not in ("asyncio", "trio"):
        raise ValueError(f"host_loop must be 'asyncio' or 'trio', got {host_loop!r}")
    runtime = AsyncioRuntime(asyncio.get_running_loop())
    if host_loop == "asyncio":
        host = runtime._host_calls.adapt(host, HOST_METHODS) if host is not None else None
        if coordinator is not None:
            coordinator = runtime._host_calls.adapt(coordinator, COORDINATOR_METHODS)
    options: dict[str, Any] = {
        "host": host,
        "durability": durability,
        "max_batch": max_batch,
        "clock": clock,
        "executors": executors,
        "coordinator": coordinator,
        "redelivery_interval": redelivery_interval,
        "retry_policy": retry_policy,
        "actor_idle_timeout": actor_idle_timeout,
        "busy_timeout": busy_timeout,
        "epoch_sweep_interval": epoch_sweep_interval,
        "task_row_cache": task_row_cache,
        "switch_interval": switch_interval,
        "run_policy": run_policy,
        "lease_sweep_interval": lease_sweep_interval,
        "retention": retention,
        "retention_every": retention_every,
        "tracer_provider": tracer_provider,
        "event_window": event_window,
    }
    thread = threading.Thread(target=runtime._thread, args=(db_path, options), name="onceflow-trio")
    thread.start()
    try:
        await _wait_through_cancellation(runtime.ready)
    except BaseException:  # opening failed, or this task was cancelled while it opened
        if runtime._token is not None:
            runtime._call_in_trio(runtime._close)
        await _wait_through_cancellation(runtime.finished)
        thread.join()
        raise
    try:
        yield runtime
    finally:
        runtime._call_in_trio(runtime._close)
        try:
            await _wait_through_cancellation(runtime.finished)
        finally:
            thread.join()
