"""The startup recovery scan: finish the step entries a crash left open.

Once per start, after the store opens and before any command is served, one query selects every
non-terminal entry in (task_id, step_id, entry_seq) order. An entry the task has left is closed
skipped(step_left); an older entry of a step the task re-entered is closed skipped(superseded); an entry
whose workflow or step no longer resolves is closed skipped(unresolvable); an entry whose clear_decisions
failed is closed as it stands; the rest are re-dispatched
(engine-owned actions only, terminal positions skipped, stale in_progress markers re-claimed by epoch).
The scan never stops the runtime from starting: a failing record, or one whose stored values cannot be
decoded, is logged at ERROR and left open.
Entries are classified, closed and re-dispatched in the writer thread, in batches of `BATCH_SIZE`, as many
batches per store request as `_recover_request` takes (issue 7: 10,000 entries took 21 s one by one); an
entry with an action that waits on the host is re-dispatched from the Trio side after its request commits.
Source: on-enter-action-dispatch.md, "Recovery" and AC-B9.
"""

from __future__ import annotations

import functools
import sqlite3

import attrs
import trio

from onceflow import metrics
from onceflow.actors.engine.on_enter import OnEnterDispatch, SegmentResult, close_entry, dispatch_order
from onceflow.actors.engine.recovery_set import SetRun, finish_common, plan_common
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.kernel.services import Services
from onceflow.logs import get_logger
from onceflow.protocol.workflow import ActionDecl
from onceflow.store import faults, step_entries, tasks
from onceflow.store.records import Marker, StepEntry
from onceflow.store.savepoint import savepoint
from onceflow.store.step_entries import EntryKey, UndecodableEntry

log = get_logger("onceflow.recovery")


BATCH_SIZE = 1024
"""Entries planned and classified together (the set path's query per step covers a batch), and about the
most entries a store request decides one by one (the per-entry path holds their events until published)."""

REQUEST_SIZE = 16 * BATCH_SIZE
"""The most entries one store request (one transaction) covers. A request takes batch after batch until it
has decided `BATCH_SIZE` entries one by one or covered this many: the set path's entries cost little to
hold, and every request costs a commit (an fsync at FULL) and two thread hand-offs, which on a loaded
machine cost more than the set statements (issue 14, bench/README.md)."""


@attrs.frozen
class _Closed:
    entry: StepEntry
    reason: str


@attrs.frozen
class _Dispatched:
    dispatch: OnEnterDispatch
    result: SegmentResult


@attrs.frozen
class _Deferred:
    """Re-dispatched from the Trio side: an action waits on the host (no executor, run_code_review)."""

    entry: StepEntry
    dispatch: OnEnterDispatch


@attrs.frozen
class _Failed:
    entry: StepEntry
    cause: str


_Recovered = _Closed | _Dispatched | _Deferred | _Failed | SetRun


async def recover_open_entries(
    services: Services, hub: EventHub, entries: list[tuple[StepEntry, int]] | None = None
) -> int:
    """Run the scan; returns how many entries were re-dispatched. Never raises.

    `entries` (each with the greatest entry_seq of its pair) replaces the query for every open entry: the
    periodic sweep of entries left by dead epochs passes its own (actors/runtime/epoch_sweep.py, issue 15).

    Entries are handled in batches of `BATCH_SIZE`, several per store request while the set path takes
    them (`REQUEST_SIZE`): classification, closing and the re-dispatch of executor-backed actions all run in
    the writer thread, every multi-write step in its own savepoint (a failing record rolls back alone, is
    logged at ERROR with its identity and stays open, AC-B9(f)); events and diagnostics are published once
    the request has committed. A request whose transaction fails (nothing of it committed) is tried again
    as its first batch alone; when that fails too, each of its entries is logged at ERROR and left open, and
    the scan goes on after it. A row whose stored values cannot be
    decoded is logged at ERROR with its identity (rowid, task, step, entry_seq) and left open, and the scan
    goes on (AC-B9(f), issue 11). Each request publishes through its own `Outbox` on `hub` and decides about
    `BATCH_SIZE` entries one by one at most, so the scan never holds every event of a large recovery
    (issue 14: the garbage collector's passes over them cost more than building them).
    """
    if entries is not None:
        return await _recover_entries(services, hub, entries)
    entries = await decodable_open_entries(services)
    return 0 if entries is None else await _recover_entries(services, hub, entries)


async def decodable_open_entries(services: Services) -> list[tuple[StepEntry, int]] | None:
    """Every open entry with the greatest entry_seq of its pair, or None when the query itself failed
    (logged at ERROR). A row whose stored values cannot be decoded is logged at ERROR with its identity and
    left out, so it stays open and is reported at every start until repaired (AC-B9(f), issue 11)."""
    try:
        rows = await services.store.transact(step_entries.open_entries)
    except Exception as exc:
        log.error("recovery_scan_query_failed", cause=repr(exc))
        return None
    entries = []
    for row in rows:
        if isinstance(row, UndecodableEntry):
            log.error(
                "recovery_entry_undecodable",
                rowid=row.rowid,
                task_id=row.task_id,
                step_id=row.step_id,
                entry_seq=row.entry_seq,
                cause=row.cause,
            )
        else:
            entries.append(row)
    return entries


async def _recover_entries(services: Services, hub: EventHub, entries: list[tuple[StepEntry, int]]) -> int:
    metrics.RECOVERED_OPEN_ENTRIES.add(len(entries))
    batches: trio.MemorySendChannel[tuple[list[_Recovered], Outbox]]
    batches, committed = trio.open_memory_channel[tuple[list[_Recovered], Outbox]](1)

    async def run_batches() -> None:  # one request ahead: the writer works while the last one is published
        async with batches:
            start, size = 0, REQUEST_SIZE
            while start < len(entries):
                now, out = services.now(), Outbox(hub, reply=False)
                request = functools.partial(
                    _recover_request,
                    services=services,
                    entries=entries[start : start + size],
                    now=now,
                    out=out,
                )
                try:
                    recovered, covered = await services.store.transact(request)
                except Exception as exc:  # the transaction itself failed: nothing of it committed
                    if size > BATCH_SIZE:  # again, its first batch alone: only a failing batch fails
                        size = BATCH_SIZE
                        continue
                    covered = min(BATCH_SIZE, len(entries) - start)
                    recovered = [_Failed(entry, repr(exc)) for entry, _ in entries[start : start + covered]]
                start, size = start + covered, REQUEST_SIZE
                await batches.send((recovered, out))

    redispatched = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_batches)
        async for recovered, out in committed:
            for item in recovered:
                redispatched += await _publish(item, out)
    return redispatched


async def _publish(item: _Recovered, out: Outbox) -> int:
    """Publish what a committed batch did for one entry, or a run of entries the set path finished (or run
    a deferred dispatch); how many entries were re-dispatched."""
    match item:
        case _Closed(entry, reason):
            out.diagnostic(
                "warning" if reason == "unresolvable" else "info",
                f"recovery_{reason}",
                task_id=entry.task_id,
                step_id=entry.step_id,
                entry_seq=entry.entry_seq,
            )
        case _Dispatched(dispatch, result):
            dispatch.publish_segment(result)
            return 1
        case SetRun():
            return item.publish(out)
        case _Deferred(entry, dispatch):
            try:
                await dispatch.run()
            except Exception as exc:
                item = _Failed(entry, repr(exc))
            else:
                return 1
    if isinstance(item, _Failed):
        log.error(
            "recovery_entry_failed",
            task_id=item.entry.task_id,
            step_id=item.entry.step_id,
            entry_seq=item.entry.entry_seq,
            cause=item.cause,
        )
    return 0


def _recover_request(
    conn: sqlite3.Connection,
    services: Services,
    entries: list[tuple[StepEntry, int]],
    now: float,
    out: Outbox,
) -> tuple[list[_Recovered], int]:
    """Batches of `entries` in order until `BATCH_SIZE` entries were decided one by one (writer thread, one
    transaction); what they did and how many entries they covered."""
    recovered: list[_Recovered] = []
    covered = one_by_one = 0
    while covered < len(entries) and one_by_one < BATCH_SIZE:
        batch = entries[covered : covered + BATCH_SIZE]
        done = _recover_batch(conn, services, batch, now, out)
        one_by_one += sum(not isinstance(item, SetRun) for item in done)
        recovered.extend(done)
        covered += len(batch)
    return recovered, covered


def _recover_batch(
    conn: sqlite3.Connection,
    services: Services,
    batch: list[tuple[StepEntry, int]],
    now: float,
    out: Outbox,
) -> list[_Recovered]:
    """The batch in order (AC-B9(c)): each run of consecutive common entries of one step set-oriented
    (`recovery_set`), every other entry, and a run the set path declined, one by one."""
    plans = plan_common(conn, services, batch)
    recovered: list[_Recovered] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            done = finish_common(conn, services, plans[run[0]], [batch[i][0] for i in run], now, out)
            if done is not None:
                recovered.append(done)
            else:
                recovered.extend(_recover(conn, services, *batch[i], now, out) for i in run)
            run.clear()

    for index, (entry, latest) in enumerate(batch):
        group = plans.get(index)
        if group is None or (run and plans[run[0]] is not group):
            flush()
        if group is not None:
            run.append(index)
        else:
            recovered.append(_recover(conn, services, entry, latest, now, out))
    flush()
    return recovered


def _recover(
    conn: sqlite3.Connection, services: Services, entry: StepEntry, latest: int, now: float, out: Outbox
) -> _Recovered:
    """Classify one open entry and close or re-dispatch it (writer thread). Closing runs in a savepoint and
    a re-dispatch isolates each action in its own, so a failing record rolls back alone."""
    try:
        return _classify(conn, services, entry, latest, now, out)
    except Exception as exc:
        if faults.ends_transaction(conn, exc):  # the batch's transaction is gone: fail it, not the record
            raise
        return _Failed(entry, repr(exc))


def _classify(
    conn: sqlite3.Connection, services: Services, entry: StepEntry, latest: int, now: float, out: Outbox
) -> _Recovered:
    key = EntryKey(entry.task_id, entry.step_id, entry.entry_seq)
    marks = step_entries.markers(conn, key)
    task = tasks.find_task(conn, entry.task_id)
    workflow = services.workflows.workflows.get(entry.workflow_id)
    step = workflow.step(entry.step_id) if workflow is not None and workflow.has_step(entry.step_id) else None
    declaration: tuple[ActionDecl, ...] = ()
    if task is None or workflow is None or step is None:
        reason = "unresolvable"
    elif task.step_id != entry.step_id or task.workflow_id != entry.workflow_id:
        reason, declaration = "step_left", step.events.on_enter
    elif latest != entry.entry_seq:  # the greatest over every entry of the pair, open or not
        reason, declaration = "superseded", step.events.on_enter
    elif _clear_failed(marks, step.events.on_enter):
        reason = "clear_failed"  # terminal as it stands: its later actions never reached a dispatcher (AC-C2)
    else:
        dispatch = OnEnterDispatch(services, task, workflow, step, key, "recovery", out)
        order = dispatch_order(step.events.on_enter, "recovery")
        if any(action.type not in services.executors for _, action in order):
            return _Deferred(entry, dispatch)
        segment = dispatch.segment(
            conn, key, order, now, check_digest=True, finish=True, entry=entry, marks=marks
        )
        return _Dispatched(dispatch, segment)
    with savepoint(conn, "close"):
        close_entry(conn, key, declaration, reason, now)
        if reason != "clear_failed":  # a claim left by a dead runtime on a position no longer declared
            step_entries.skip_claimed_markers(conn, key, reason, now)
    return _Closed(entry, reason)


def _clear_failed(marks: dict[int, Marker], declaration: tuple[ActionDecl, ...]) -> bool:
    return any(
        action.type == "clear_decisions" and position in marks and marks[position].state == "failed"
        for position, action in enumerate(declaration)
    )
