"""The periodic sweep of entries whose epoch is dead, on PostgreSQL (issue 15, "Epoch liveness").

On SQLite the start-up recovery scan is enough: the runtime owning the file is the only one, and what a
dead one left is finished when the file is next opened. On PostgreSQL the runtime that left an entry open
(SIGKILLed, partitioned past `postgres.PARTITION_BOUND`) may never come back while others keep serving, so
every live runtime looks every `interval` seconds for open entries holding an in_progress marker of a dead
epoch (`epochs.dead_epoch_entries`) and finishes them through the recovery path, one entry at a time under
that entry's task lock (so never concurrently with a command of the task in another runtime). The markers'
compare-and-set decides which runtime wins when several sweep at once.
"""

from __future__ import annotations

import trio

from onceflow.actors.outbox import EventHub
from onceflow.actors.recovery import decodable_open_entries, recover_open_entries
from onceflow.actors.services import Services
from onceflow.logs import get_logger
from onceflow.store import epochs
from onceflow.store.records import StepEntry

log = get_logger("onceflow.epoch_sweep")

SWEEP_INTERVAL = 5.0
"""Seconds between two sweeps of a live PostgreSQL runtime."""


async def sweep_once(services: Services, hub: EventHub) -> int:
    """Finish the open entries of dead epochs once; returns how many were re-dispatched. Never raises."""
    store = services.store
    try:
        # The epoch is read in the writer: a reconnect there may have replaced it.
        found = await store.transact(lambda conn: epochs.dead_epoch_entries(conn, store.epoch))
    except Exception as exc:
        log.warning("epoch_sweep_query_failed", cause=repr(exc))
        return 0
    redispatched = await _each_under_its_task_lock(services, hub, found)
    if found:
        log.info("epoch_sweep_finished", entries=len(found), redispatched=redispatched)
    return redispatched


async def recover_at_start(services: Services, hub: EventHub) -> int:
    """The start-up recovery scan of a runtime on PostgreSQL; returns how many entries were re-dispatched.
    Never raises.

    Other runtimes may be serving the same tasks meanwhile, so unlike SQLite's batched scan each open entry
    is recovered in its own transactions under its task's lock, never concurrently with a command of that
    task. An undecodable row is logged at ERROR and left open, as on SQLite (AC-B9(f)).
    """
    found = await decodable_open_entries(services)
    return 0 if found is None else await _each_under_its_task_lock(services, hub, found)


async def _each_under_its_task_lock(
    services: Services, hub: EventHub, entries: list[tuple[StepEntry, int]]
) -> int:
    redispatched = 0
    for entry in entries:
        epochs.CURRENT_TASK.set(entry[0].task_id)  # the recovery's transactions take this task's lock
        try:
            redispatched += await recover_open_entries(services, hub, [entry])
        finally:
            epochs.CURRENT_TASK.set(None)
    return redispatched


async def sweep_forever(
    services: Services,
    hub: EventHub,
    interval: float = SWEEP_INTERVAL,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `sweep_once` every `interval` seconds; `start` it to get the cancel scope that stops it."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            await trio.sleep(interval)
            await sweep_once(services, hub)
