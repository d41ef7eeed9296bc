"""The periodic sweep of entries whose epoch is dead, on PostgreSQL. Trio thread.

On SQLite the start-up recovery scan is enough: the runtime owning the file is the only one, and what a
dead one left is finished when the file is next opened. On PostgreSQL the runtime that left an entry open
(SIGKILLed, partitioned past `postgres.PARTITION_BOUND`) may never come back while others keep serving, so
every live runtime looks every `interval` seconds for open entries holding no claim of a live epoch and
either holding an in_progress marker of a dead epoch or created by a dead epoch (`created_epoch`: a dead
runtime's entry committed but never claimed), or, of unknown creating epoch (created before the column
existed), older than `grace` (`GRACE_INTERVALS` sweeps): `epochs.dead_epoch_entries`. So a live runtime's
own dispatch, however long it waits on a host action, is never raced while its epoch lives.
It finishes them through the recovery scan (actors/engine/recovery.py), which holds each entry's task lock
while it decides the entry (so never concurrently with a command of the task in another runtime), common
entries set-oriented. The markers' compare-and-set with epochs decides which runtime runs each engine
action when several sweep at once, or when a sweep races a dispatch whose epoch died under it (a lost
connection renews the epoch) or of an entry older than `grace` with no creating epoch: the sweep then runs
the entry's remaining engine actions, each once, possibly before a host action the dispatch waits on
completes. An entry its live runtime left open (an executor's transient failure, AC-B9(f)) waits, as on
SQLite, for that epoch to end (then the next sweep, or a restart's scan).
Then it runs the start-up promotion (`promote`), so a WIP slot a dead runtime freed without promoting (or
whose promotion failed `storage_busy`) is filled while tasks wait.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
from trio.lowlevel import enable_ki_protection

from onceflow.actors.engine.recovery import recover_open_entries
from onceflow.actors.kernel.outbox import EventHub
from onceflow.actors.kernel.services import Services
from onceflow.observability.logs import get_logger
from onceflow.store.backends import epochs

log = get_logger("onceflow.epoch_sweep")

SWEEP_INTERVAL = 5.0
"""Seconds between two sweeps of a live PostgreSQL runtime."""

GRACE_INTERVALS = 12
"""How many sweep intervals a claimless open entry of unknown creating epoch (created before the
`created_epoch` column, or on a session holding no epoch) must be old before a sweep takes it (60 s at the
default interval): such an entry may be a live runtime's whose dispatch waits on a host action, which the
grace makes rare (and then each engine action still runs once). An entry whose creating epoch is known
needs no grace: it is taken at the first sweep after that epoch is dead, never while it lives."""

SWEEP_LIMIT = 100
"""The most entries one sweep finishes (the next sweep takes the rest)."""


async def sweep_once(
    services: Services,
    hub: EventHub,
    grace: float,
    promote: Callable[[], Awaitable[int]] | None = None,
) -> int:
    """Finish, once, the open entries of dead epochs (claimed or created by one) and the claimless ones of
    unknown creating epoch created more than `grace` seconds ago (at most `SWEEP_LIMIT`), then run `promote`
    (the start-up promotion); returns how many entries were re-dispatched. Never raises: a failure is
    logged at WARNING."""
    store = services.store
    before = services.now() - grace
    try:
        # The epoch is read in the writer: a reconnect there may have replaced it.
        found = await store.transact(epochs.dead_epoch_entries, store, before, SWEEP_LIMIT)
    except Exception as exc:
        log.warning("epoch_sweep_query_failed", cause=repr(exc))
        found = []
    redispatched = await recover_open_entries(services, hub, found) if found else 0
    if found:
        log.info("epoch_sweep_finished", entries=len(found), redispatched=redispatched)
    if promote is not None:
        try:
            promoted = await promote()
        except Exception as exc:  # storage_busy and the like: the next sweep tries again
            log.warning("epoch_sweep_promotion_failed", cause=repr(exc))
        else:
            if promoted:
                log.info("epoch_sweep_promoted", tasks=promoted)
    return redispatched


@enable_ki_protection
async def sweep_forever(
    services: Services,
    hub: EventHub,
    interval: float = SWEEP_INTERVAL,
    promote: Callable[[], Awaitable[int]] | None = None,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `sweep_once` every `interval` seconds, with a grace of `GRACE_INTERVALS` intervals for claimless
    entries of unknown creating epoch; `start` it to get the cancel scope that stops it."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            await trio.sleep(interval)
            await sweep_once(services, hub, GRACE_INTERVALS * interval, promote)
