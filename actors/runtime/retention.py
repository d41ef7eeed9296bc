"""The retention task: resolved history deleted in bounded background batches. Trio thread: each batch is
one short store transaction (store/retention.py), and the task yields between batches so commands go on.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from onceflow import metrics
from onceflow.actors.kernel.services import Services
from onceflow.logs import get_logger
from onceflow.store import retention
from onceflow.store.retention import Pruned
from onceflow.store.writer import StoreActor

log = get_logger("onceflow.retention")

RETENTION_INTERVAL = 300.0
"""Seconds between two retention passes (`open_runtime(retention_interval=...)`)."""

BATCH = 500
"""Rows of each kind one batch deletes at most."""


async def prune(
    store: StoreActor, clock: Callable[[], float], retention_seconds: float, batch: int = BATCH
) -> dict[str, int]:
    """Delete everything older than `retention_seconds` before `clock()` (Unix seconds; store/retention.py),
    one batch per transaction until a batch finds less than `batch` of every kind; returns the rows deleted
    per kind. Counted in
    the `onceflow.retention.deleted` metric. Raises the store's typed errors (`StorageError`); what the
    batches before committed stays deleted, and a cancellation leaves the batches so far committed."""
    total = dict.fromkeys(retention.KINDS, 0)
    while True:
        pruned: Pruned = await store.transact(retention.prune_batch, clock(), retention_seconds, batch)
        for kind, count in pruned.deleted.items():
            if count:
                total[kind] += count
                metrics.RETENTION_DELETED.add(count, {"kind": kind})
        if not pruned.full:
            return total
        await trio.sleep(0)  # let commands in between two batches


async def prune_forever(
    services: Services,
    retention_seconds: float,
    interval: float = RETENTION_INTERVAL,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `prune` every `interval` seconds; `start` it to get the cancel scope that stops it. A failing
    pass is logged at WARNING and tried again at the next interval."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            await trio.sleep(interval)
            try:
                deleted = await prune(services.store, services.clock, retention_seconds)
            except Exception as exc:
                log.warning("retention_failed", cause=repr(exc))
                continue
            if any(deleted.values()):
                log.info("retention_pruned", **deleted)
