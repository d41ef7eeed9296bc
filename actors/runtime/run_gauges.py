"""Keeping the queued- and claimed-run gauges current (onceflow/metrics.py `onceflow.runs.queued`,
`onceflow.runs.claimed`). Trio thread: each reading is one store request (store/open_runs.py).

Every `interval` seconds, while a meter provider with an SDK is set (`metrics.recording`), the runtime
counts its database's open runs per agent profile and hands the counts to the gauges, which the reader
observes on its own thread; with no SDK it reads nothing. A failed reading is logged at WARNING and the
gauges keep the last counts until the next one.
"""

from __future__ import annotations

import trio

from onceflow import metrics
from onceflow.actors.kernel.services import Services
from onceflow.logs import get_logger
from onceflow.store.open_runs import count_open_runs

log = get_logger("onceflow.run_gauges")

RUN_GAUGE_INTERVAL = 10.0
"""Seconds between two readings of the open-run counts (`open_runtime(run_gauge_interval=...)`)."""


async def read_open_runs(services: Services, owner: object) -> bool:
    """Read the open-run counts once and report them for `owner` (the runtime); False, having read
    nothing, while no SDK records metrics or when the reading failed (logged at WARNING)."""
    if not metrics.recording():
        return False
    try:
        counts = await services.store.transact(count_open_runs)
    except Exception as exc:
        log.warning("run_gauge_read_failed", cause=repr(exc))
        return False
    metrics.report_open_runs(owner, counts)
    return True


async def gauge_open_runs_forever(
    services: Services,
    owner: object,
    interval: float = RUN_GAUGE_INTERVAL,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`read_open_runs` at once, then every `interval` seconds; `start` it to get the cancel scope that
    stops it. Once stopped, `owner`'s counts are no longer observed."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        try:
            while True:
                await read_open_runs(services, owner)
                await trio.sleep(interval)
        finally:
            metrics.forget_open_runs(owner)
