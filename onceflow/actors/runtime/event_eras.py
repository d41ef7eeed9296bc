"""The event stream's eras: the first one at start, the next each time half of a block of seqs is used
(actors/kernel/event_window.py lays the seqs out). Trio thread: each era is one short store transaction
(store/event_eras.py).
"""

from __future__ import annotations

import trio
from trio.lowlevel import enable_ki_protection

from onceflow.actors.kernel.event_window import MAX_ERA, EventWindow
from onceflow.observability.logs import get_logger
from onceflow.store.event_eras import next_era
from onceflow.store.writer import StoreActor

log = get_logger("onceflow.event_eras")

RETRY_SECONDS = 1.0
"""Seconds between two attempts at the next era after a failed one (2**23 events of headroom remain)."""


async def first_era(store: StoreActor) -> int:
    """This start's era, durable before any event is numbered in it. Raises the store's typed errors, and
    RuntimeError once the database's eras are used up (`MAX_ERA`: about 5e8 starts and renewals)."""
    era = await store.transact(next_era)
    if era > MAX_ERA:
        raise RuntimeError(
            f"the event_seq eras of this database are used up ({era} > {MAX_ERA}): event_seqs would pass"
            " 2**53"
        )
    return era


@enable_ki_protection
async def renew_eras_forever(
    store: StoreActor,
    window: EventWindow,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Each time `window` asks for a new era (half its block used), allocate one and hand it over; `start`
    it to get the cancel scope that stops it. A failed allocation is logged at WARNING and tried again
    every `RETRY_SECONDS`. Holds no timer while no era is wanted."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            await window.renewal.wait()
            try:
                era = await store.transact(next_era)
            except Exception as exc:
                log.warning("event_era_failed", cause=repr(exc), retry_seconds=RETRY_SECONDS)
                await trio.sleep(RETRY_SECONDS)
                continue
            if not window.adopt(era):
                return  # the eras are used up (logged): the block runs on
