"""The retention task: resolved history deleted in bounded background batches. Trio thread: each batch is
one short store transaction (store/retention/retention.py), and the task yields between batches so commands go
on.

A pass runs at start-up and then after every `RETENTION_EVERY` events that leave history behind (step
entries, resolved runs, decisions, acknowledged outcomes: `RetentionTrigger`), not on a timer: history grows
only with activity, so pruning in step with it keeps the database bounded, and an idle runtime holds no
timer (a host's `trio.testing.MockClock` autojump never lands on one). `onceflow prune` prunes an idle
database on demand.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
from trio.lowlevel import enable_ki_protection

from onceflow.actors.kernel.services import Services
from onceflow.observability import metrics
from onceflow.observability.logs import get_logger
from onceflow.protocol.events import Event
from onceflow.store.retention import retention
from onceflow.store.retention.retention import Pruned
from onceflow.store.writer import StoreActor

log = get_logger("onceflow.retention")

RETENTION_EVERY = 1000
"""Events that leave history behind between two retention passes (`open_runtime(retention_every=...)`)."""

HISTORY_EVENTS = frozenset(
    {"step_entered", "run_finished", "run_failed", "run_cancelled", "decision_recorded", "diagnostic"}
)
"""The events `RetentionTrigger` counts (a diagnostic only when it is `outcome_acknowledged`)."""


class RetentionTrigger:
    """Counts the events that leave history behind (the hub's hook, `on_publish`); `due` is set once
    `every` of them were published since the last pass."""

    watches = HISTORY_EVENTS
    """The event types the hub tells it of (`on_publish`)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.count = 0
        self.due = trio.Event()

    def on_publish(self, event: Event) -> None:
        if event.type != "diagnostic" or getattr(event, "code", "") == "outcome_acknowledged":
            self.count += 1
            if self.count >= self.every:
                self.due.set()

    def reset(self) -> None:
        """A pass begins: count afresh."""
        self.count = 0
        if self.due.is_set():
            self.due = trio.Event()


BATCH = 500
"""Rows of each kind one batch deletes at most."""


async def prune(
    store: StoreActor, clock: Callable[[], float], retention_seconds: float, batch: int = BATCH
) -> dict[str, int]:
    """Delete everything older than `retention_seconds` before `clock()` (Unix seconds;
    store/retention/retention.py), one batch per transaction until a batch finds less than `batch` of every
    kind; returns the rows deleted per kind. Counted in
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


@enable_ki_protection
async def prune_forever(
    services: Services,
    retention_seconds: float,
    trigger: RetentionTrigger,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `prune` at once, then each time `trigger` is due; `start` it to get the cancel scope that stops
    it. A failing pass is logged at WARNING and tried again when the trigger is next due."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            trigger.reset()
            try:
                deleted = await prune(services.store, services.clock, retention_seconds)
            except Exception as exc:
                log.warning("retention_failed", cause=repr(exc))
            else:
                if any(deleted.values()):
                    log.info("retention_pruned", **deleted)
            await trigger.due.wait()
