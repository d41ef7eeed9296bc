"""Keeping the queued- and claimed-run gauges current (onceflow/observability/metrics.py
`onceflow.runs.queued`,
`onceflow.runs.claimed`). Trio thread: each reading is one store request (store/runs/open_runs.py).

Pulled, never on a timer: each time a metric reader collects the gauges (on its own thread), they report
the latest counts and ask the runtime for a fresh reading, which it takes at once; it also reads once at
start when a meter provider with an SDK is set. So without an SDK nothing is ever read, and a collection
shows the counts as of the one before (or the start). A failed reading is logged at WARNING and the
gauges keep the last counts.
"""

from __future__ import annotations

import contextlib

import trio
from trio.lowlevel import enable_ki_protection

from onceflow.actors.kernel.services import Services
from onceflow.observability import metrics
from onceflow.observability.logs import get_logger
from onceflow.store.runs.open_runs import count_open_runs

log = get_logger("onceflow.run_gauges")


async def read_open_runs(services: Services, owner: object) -> bool:
    """Read the open-run counts once and report them for `owner` (the runtime); False, having reported
    nothing, when the reading failed (logged at WARNING)."""
    try:
        counts = await services.store.transact(count_open_runs)
    except Exception as exc:
        log.warning("run_gauge_read_failed", cause=repr(exc))
        return False
    metrics.report_open_runs(owner, counts)
    return True


@enable_ki_protection
async def gauge_open_runs_forever(
    services: Services,
    owner: object,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Read the open-run counts for `owner` whenever a collection of the gauges asks (and once now, when an
    SDK records metrics); `start` it to get the cancel scope that stops it. Holds no timer. Once stopped,
    `owner`'s counts are no longer observed."""
    token = trio.lowlevel.current_trio_token()
    wanted = _Wanted()

    def ask() -> None:  # the metric reader's thread, or any
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(wanted.set)

    with trio.CancelScope() as scope:
        task_status.started(scope)
        metrics.watch_open_runs(owner, ask)
        try:
            if metrics.recording():
                await read_open_runs(services, owner)
            while True:
                await wanted.wait()
                await read_open_runs(services, owner)
        finally:
            metrics.forget_open_runs(owner)


class _Wanted:
    """A reading was asked for since the last one began (set on the Trio thread)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = trio.Event()
