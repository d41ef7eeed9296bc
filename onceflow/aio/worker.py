"""The runs worker under asyncio: `rt.runs(agent)` of `onceflow.aio`. The caller's asyncio thread; the
claims, renewals and finishes run on the runtime's Trio thread, in the one worker both faces share
(actors/runtime/worker.py `RunWorker`, whose docstring gives the rules).

    async with rt.runs("reviewer") as runs:
        async for run in runs:
            async with run:  # renewed on the Trio thread meanwhile; finished (or failed) on leaving
                await review(run.task_id, run.payload)

The body runs on the asyncio loop. A lost claim cancels the task that entered `async with run` (as
`asyncio.timeout` does: the block's CancelledError is absorbed on leaving, and `Task.uncancel` keeps a
cancellation from elsewhere intact); a cancellation from elsewhere hands the run back and propagates. A
cancelled `__anext__` cancels the claim on the Trio thread, which claims nothing; leaving `async with runs`
(even cancelled) waits until the worker is closed on the Trio thread, every run it handed out finished or
handed back. When the runtime closes first, the worker closes with it: a body still running is cancelled
and its run handed back.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio

from onceflow.actors.runtime.worker import HANDED_BACK, Run
from onceflow.observability.logs import get_logger
from onceflow.protocol.errors import ShuttingDownError, shown
from onceflow.protocol.results import ClaimedRun

if TYPE_CHECKING:
    from onceflow.actors.runtime.supervisor import Runtime


class Bridge(Protocol):
    """What a worker uses of the asyncio bridge (`AsyncioRuntime`, onceflow/aio.py, which makes the
    workers): its Trio-side runtime and nursery, whether it accepts work, its stop event and its two
    thread hops; named here so that the two modules do not import each other."""

    _runtime: Runtime | None
    _pumps: trio.Nursery | None
    _stop: trio.Event
    _accepting: bool

    def _call_in_trio(self, function: Callable[..., None], *args: Any) -> bool: ...

    def _call_in_asyncio(self, function: Callable[..., None], *args: Any) -> None: ...


T = TypeVar("T")

log = get_logger("onceflow.worker")


class _Closed:
    """What a call answers when the worker closed before (or while) it ran."""


_CLOSED = _Closed()


class AsyncioRun(Run):
    """A `Run` whose body runs on the asyncio loop (`async with run` in an asyncio task)."""

    def __init__(self, runs: AsyncioRuns, info: ClaimedRun) -> None:
        super().__init__(runs._worker, info)
        self._runs = runs
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._cancelled_by_loss = False
        self._left = False

    def _cancel_body(self) -> None:  # Trio thread
        self._runs._owner._call_in_asyncio(self._cancel_task)

    def _cancel_task(self) -> None:  # asyncio thread
        if self._task is not None and not self._left and not self._cancelled_by_loss:
            self._cancelled_by_loss = True
            self._task.cancel()

    async def __aenter__(self) -> AsyncioRun:
        self._enter()
        self._task = asyncio.current_task()
        assert self._task is not None
        self._cancelling = self._task.cancelling()
        self._runs._owner._call_in_trio(self._runs._worker._begin, self)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self._left = True
        absorbed = False
        if self._cancelled_by_loss and self._task is not None:
            absorbed = self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError
        error = None if absorbed else exc
        end = functools.partial(self._runs._worker._end, cancelled=absorbed)
        _, cancelled = await self._runs._call(end, self, error)
        if cancelled and not isinstance(error, asyncio.CancelledError):
            raise asyncio.CancelledError
        return error is None or isinstance(error, Exception)


class AsyncioRuns:
    """`onceflow.aio` `rt.runs(agent_profile_id, ...)`: the asyncio face of a `RunWorker` (module
    docstring); the options are `Runtime.runs`'s (`lease_seconds`, `wait_seconds`, `until_idle`,
    `cancel_superseded`).

    Raises (at construction):
        ProtocolError: a bad option, naming the field.
        ShuttingDownError: the runtime is not open.
    """

    def __init__(self, owner: Bridge, agent_profile_id: str | Sequence[str] | None, **options: Any) -> None:
        if owner._runtime is None or not owner._accepting:
            raise ShuttingDownError("the runtime is shutting down")
        self._owner = owner
        self._worker = owner._runtime.runs(agent_profile_id, **options)
        self._loop = asyncio.get_running_loop()
        self._close: trio.Event | None = None  # Trio thread
        self._closed: asyncio.Future[None] = self._loop.create_future()
        self._session_over = False  # Trio thread
        self._entered = False

    @property
    def agent_profile_id(self) -> str:
        """The agent profile whose runs it claims."""
        return self._worker.agent_profile_id

    async def __aenter__(self) -> AsyncioRuns:
        ready: asyncio.Future[None] = self._loop.create_future()
        if not self._owner._call_in_trio(self._start, ready):
            raise ShuttingDownError("the runtime is shutting down")
        try:
            await _wait_through(ready)
        except BaseException:
            self._owner._call_in_trio(self._stop_session)
            await _wait_through(self._closed)
            raise
        self._entered = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self._owner._call_in_trio(self._stop_session)
        await _wait_through(self._closed)
        return False

    def stop(self) -> None:
        """Claim no more (`RunWorker.stop`): a waiting claim ends and the iteration stops."""
        self._owner._call_in_trio(self._worker.stop)

    def __aiter__(self) -> AsyncioRuns:
        return self

    async def __anext__(self) -> AsyncioRun:
        if not self._entered:
            raise RuntimeError("iterate it inside `async with rt.runs(...) as runs`")
        run, cancelled = await self._call(self._worker._next, self._make)
        if cancelled:
            if isinstance(run, Run):  # claimed as the wait was cancelled: hand it back before going
                await self._call(self._worker._end, run, HANDED_BACK)
            raise asyncio.CancelledError
        if not isinstance(run, AsyncioRun):
            raise StopAsyncIteration
        return run

    def _make(self, info: ClaimedRun) -> Run:  # Trio thread
        return AsyncioRun(self, info)

    # Trio thread ------------------------------------------------------------------------------

    def _start(self, ready: asyncio.Future[None]) -> None:
        pumps = self._owner._pumps
        if not self._owner._accepting or pumps is None:
            self._owner._call_in_asyncio(
                _settle, ready, None, ShuttingDownError("the runtime is shutting down")
            )
            self._owner._call_in_asyncio(_settle, self._closed, None)
            return
        self._close = trio.Event()
        pumps.start_soon(self._session, ready)

    def _stop_session(self) -> None:
        if self._close is not None:
            self._close.set()

    async def _session(self, ready: asyncio.Future[None]) -> None:
        """Hold the worker open until the asyncio side leaves it or the runtime stops."""
        assert self._close is not None
        try:
            async with self._worker:
                self._owner._call_in_asyncio(_settle, ready, None)
                async with trio.open_nursery() as watch:
                    for event in (self._close, self._owner._stop):
                        watch.start_soon(_cancel_when_set, event, watch.cancel_scope)
        except Exception as exc:  # never into the runtime's nursery: the asyncio side hears of it
            log.error(
                "run_worker_failed", agent_profile_id=self.agent_profile_id, cause=shown(exc), exc_info=exc
            )
            self._owner._call_in_asyncio(_settle, ready, None, exc)
        finally:
            self._session_over = True
            self._owner._call_in_asyncio(_settle, ready, None, ShuttingDownError("the worker closed"))
            self._owner._call_in_asyncio(_settle, self._closed, None)

    def _submit(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], future: asyncio.Future[Any]
    ) -> trio.CancelScope | None:
        nursery = self._worker._nursery
        if nursery is None or self._session_over:
            self._owner._call_in_asyncio(_settle, future, _CLOSED)
            return None
        scope = trio.CancelScope()
        nursery.start_soon(self._bridge, fn, args, future, scope)
        return scope

    async def _bridge(
        self,
        fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        future: asyncio.Future[Any],
        scope: trio.CancelScope,
    ) -> None:
        result: Any = _CLOSED
        try:
            with scope:
                result = await fn(*args)
        except Exception as exc:
            self._owner._call_in_asyncio(_settle, future, None, exc)
        finally:
            self._owner._call_in_asyncio(_settle, future, result)

    # asyncio thread ---------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> tuple[Any, bool]:
        """Run `fn(*args)` on the Trio thread in the worker's nursery and wait for it, through a
        cancellation of this task (which cancels the call on the Trio thread): (its result, or `_CLOSED`
        once the worker closed; whether this task was cancelled meanwhile). Raises what `fn` raised."""
        future: asyncio.Future[Any] = self._loop.create_future()
        scopes: list[trio.CancelScope] = []

        def submit() -> None:
            scope = self._submit(fn, args, future)
            if scope is not None:
                scopes.append(scope)

        def cancel() -> None:  # after `submit` (the Trio token is first in first out)
            for scope in scopes:
                scope.cancel()

        if not self._owner._call_in_trio(submit):
            return _CLOSED, False
        cancelled = False
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                if not cancelled and not self._owner._call_in_trio(cancel):
                    _settle(future, _CLOSED)
                cancelled = True
        return future.result(), cancelled


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _settle(future: asyncio.Future[T], result: T, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


async def _wait_through(future: asyncio.Future[T]) -> T:
    """Await `future` to the end even if this task is cancelled meanwhile, then re-raise the cancel."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return future.result()
