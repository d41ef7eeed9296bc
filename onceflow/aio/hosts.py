"""Host and coordinator methods written for asyncio, run on the caller's asyncio loop. Trio thread (every
method here is called there), with one done-callback per call that runs on the asyncio thread.

Under `onceflow.aio.open_runtime` the runtime runs on its own Trio thread, where an asyncio coroutine cannot
run (`RuntimeError: no running event loop`). `AsyncioCalls.adapt` wraps a `Host` or `Coordinator` so that
each of its coroutine methods is submitted to the asyncio loop (`asyncio.run_coroutine_threadsafe`) and
awaited from Trio on a `trio.Event` the future's done-callback sets through the Trio token: neither thread
ever blocks on the other. Methods that are not coroutine functions, and `BaseHost`'s own no-op methods, are
called on the Trio thread as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

import trio

from onceflow.protocol.host import BaseHost

T = TypeVar("T")

HOST_METHODS = ("perform_session_action", "start_code_review", "preflight_transition")
"""The `Host` methods (protocol/host.py) that may run on the asyncio loop."""
COORDINATOR_METHODS = ("deliver", "acknowledge")
"""The `Coordinator` methods (protocol/coordinator.py) that may run on the asyncio loop."""


class HostCallCancelledError(Exception):
    """An asyncio host or coordinator call that did not complete: the runtime is shutting down (the call
    was cancelled on the asyncio loop, or never submitted), or the coroutine was cancelled on its own loop.

    It is an `Exception`, so the runtime reports it as the host's failure of that call (a
    `session_action_failed` diagnostic with `error_type` "HostCallCancelledError", a failed delivery
    attempt, ...) and goes on.
    """


class _Adapted:
    """`target` with some methods replaced by their asyncio crossings; every other attribute is target's."""

    def __init__(self, target: object, crossings: dict[str, Callable[..., Any]]) -> None:
        self._target = target
        self.__dict__.update(crossings)

    def __getattr__(self, name: str) -> Any:  # only for names not set on the instance
        if name == "_target":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._target, name)

    def __repr__(self) -> str:
        return f"asyncio({self._target!r})"


class AsyncioCalls:
    """The asyncio loop that adapted coroutine methods run on, and the calls pending on it (one per
    `onceflow.aio.open_runtime`).

    `loop` must keep running while the runtime is open (it is the loop that opened it). After `close` no
    call is submitted any more and the pending ones are cancelled on the loop: the runtime's shutdown never
    waits for asyncio host code.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: set[concurrent.futures.Future[Any]] = set()  # Trio thread only
        self._closed = False

    def adapt(self, target: T, names: tuple[str, ...]) -> T:
        """`target` itself when none of its methods `names` is a coroutine function to run on asyncio (None
        stays None); otherwise an object that behaves as `target` except that those methods run on the
        loop. Decided once, here: a method replaced on `target` later is not seen."""
        crossings: dict[str, Callable[..., Any]] = {}
        for name in names:
            method = getattr(target, name, None)
            if method is not None and _runs_on_asyncio(method, name):
                crossings[name] = self._crossing(method, name)
        return target if not crossings else cast(T, _Adapted(target, crossings))

    def close(self) -> None:
        """Cancel every pending call on the asyncio loop and refuse later ones (Trio thread; idempotent).

        Each cancelled call's Trio side raises `HostCallCancelledError` at once, without waiting for the
        asyncio task to finish its own clean-up."""
        self._closed = True
        for future in list(self._pending):
            future.cancel()

    def _crossing(
        self, method: Callable[..., Coroutine[Any, Any, Any]], name: str
    ) -> Callable[..., Coroutine[Any, Any, Any]]:
        async def crossing(*args: Any, **kwargs: Any) -> Any:
            return await self.call(name, method, *args, **kwargs)

        return crossing

    async def call(
        self, name: str, method: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any
    ) -> T:
        """Run `method(*args, **kwargs)` as a task on the asyncio loop and return its result (Trio thread).

        Raises what the coroutine raised, as itself. A cancelled Trio side (a timeout, the runtime's
        shutdown) cancels the asyncio task and re-raises trio.Cancelled at once.

        Raises:
            HostCallCancelledError: `close` was called (before or during the call), the loop is closed, or
                the coroutine was cancelled on the asyncio side.
        """
        if self._closed:
            raise HostCallCancelledError(f"{name} was not called: the runtime is shutting down")
        coroutine = method(*args, **kwargs)
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        except RuntimeError as exc:  # the loop is closed
            coroutine.close()
            raise HostCallCancelledError(f"{name} was not called: the asyncio loop is closed") from exc
        token, done = trio.lowlevel.current_trio_token(), trio.Event()

        def wake(_: object) -> None:  # the asyncio thread, or this one when cancelled from here
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        future.add_done_callback(wake)
        self._pending.add(future)
        try:
            await done.wait()
        finally:
            self._pending.discard(future)
            future.cancel()  # a no-op once done; cancels the asyncio task when Trio gave up first
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            why = "the runtime is shutting down" if self._closed else "it was cancelled on the asyncio loop"
            raise HostCallCancelledError(f"{name} did not complete: {why}") from None


def _runs_on_asyncio(method: Callable[..., Any], name: str) -> bool:
    """A coroutine function other than `BaseHost`'s own no-op of that name."""
    base = getattr(BaseHost, name, None)
    inherited = base is not None and getattr(method, "__func__", None) is base
    return inspect.iscoroutinefunction(method) and not inherited
