"""The recovery scan's writer side: classify, close and re-dispatch the open entries of one request.
Writer thread: every function runs inside one store transaction, on step plans handed in by the Trio side
(actors/engine/recovery.py), and returns plain data for it to publish.

An entry the task has left is closed skipped(step_left); an older entry of a step the task re-entered is
closed skipped(superseded); an entry whose workflow or step no longer resolves is closed
skipped(unresolvable); an entry whose clear_decisions failed is closed as it stands; the rest are
re-dispatched (engine-owned actions only, terminal positions skipped, stale in_progress markers re-claimed
by epoch), set-oriented where the set path takes them (store/recovery_set.py), else one by one, every
multi-write step in its own savepoint so a failing record rolls back alone. An entry with an action that
waits on the host is left to the Trio side (`Deferred`). Source: on-enter-action-dispatch.md, "Recovery"
and AC-B9.
"""

from __future__ import annotations

import attrs

from onceflow.protocol.workflow import ActionDecl
from onceflow.store import faults, step_entries, tasks
from onceflow.store.connection import Connection
from onceflow.store.epochs import EpochSource
from onceflow.store.records import Marker, StepEntry, TaskRecord
from onceflow.store.recovery_set import SetRun, StepPlans, finish_common, plan_common
from onceflow.store.savepoint import savepoint
from onceflow.store.segment import Segment, SegmentResult, close_entry, run_segment
from onceflow.store.step_entries import EntryKey

BATCH_SIZE = 1024
"""Entries planned and classified together (the set path's query per step covers a batch), and about the
most entries a store request decides one by one (the per-entry path holds their events until published)."""

REQUEST_SIZE = 16 * BATCH_SIZE
"""The most entries one store request (one transaction) covers. A request takes batch after batch until it
has decided `BATCH_SIZE` entries one by one or covered this many: the set path's entries cost little to
hold, and every request costs a commit (an fsync at FULL) and two thread hand-offs, which on a loaded
machine cost more than the set statements (bench/README.md)."""


@attrs.frozen
class Closed:
    """An entry closed without dispatch: skipped(`reason`), or as it stands (`clear_failed`)."""

    entry: StepEntry
    reason: str


@attrs.frozen
class Dispatched:
    """An entry re-dispatched in the request: its task and what its segment did."""

    entry: StepEntry
    task: TaskRecord
    result: SegmentResult


@attrs.frozen
class Deferred:
    """An entry to re-dispatch from the Trio side: one of its actions waits on the host."""

    entry: StepEntry
    task: TaskRecord


@attrs.frozen
class Failed:
    """An entry whose record failed (left open, logged at ERROR)."""

    entry: StepEntry
    cause: str


Recovered = Closed | Dispatched | Deferred | Failed | SetRun


def recover_request(
    conn: Connection,
    plans: StepPlans,
    entries: list[tuple[StepEntry, int]],
    source: EpochSource,
    now: float,
    audience: bool,
) -> tuple[list[Recovered], int]:
    """Batches of `entries` (each with the greatest entry_seq of its pair) in order until `BATCH_SIZE`
    entries were decided one by one; what they did and how many entries they covered. `audience`: whether
    the events will have a receiver (the set path reads back what it did only then).

    Raises:
        sqlite3.Error: an error that ended the transaction (nothing of the request commits).
    """
    recovered: list[Recovered] = []
    covered = one_by_one = 0
    while covered < len(entries) and one_by_one < BATCH_SIZE:
        batch = entries[covered : covered + BATCH_SIZE]
        done = _recover_batch(conn, plans, batch, source, now, audience)
        one_by_one += sum(not isinstance(item, SetRun) for item in done)
        recovered.extend(done)
        covered += len(batch)
    return recovered, covered


def _recover_batch(
    conn: Connection,
    plans: StepPlans,
    batch: list[tuple[StepEntry, int]],
    source: EpochSource,
    now: float,
    audience: bool,
) -> list[Recovered]:
    """The batch in order (AC-B9(c)): each run of consecutive common entries of one step set-oriented, every
    other entry, and a run the set path declined, one by one."""
    groups = plan_common(conn, plans, batch)
    recovered: list[Recovered] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            done = finish_common(conn, groups[run[0]], [batch[i][0] for i in run], now, audience)
            if done is not None:
                recovered.append(done)
            else:
                recovered.extend(_recover(conn, plans, *batch[i], source, now) for i in run)
            run.clear()

    for index, (entry, latest) in enumerate(batch):
        group = groups.get(index)
        if group is None or (run and groups[run[0]] is not group):
            flush()
        if group is not None:
            run.append(index)
        else:
            recovered.append(_recover(conn, plans, entry, latest, source, now))
    flush()
    return recovered


def _recover(
    conn: Connection, plans: StepPlans, entry: StepEntry, latest: int, source: EpochSource, now: float
) -> Recovered:
    """Classify one open entry and close or re-dispatch it. Closing runs in a savepoint and a re-dispatch
    isolates each action in its own, so a failing record rolls back alone."""
    try:
        return _classify(conn, plans, entry, latest, source, now)
    except Exception as exc:
        if faults.fails_request(conn, exc):  # the database's fault: fail the request, not the record
            raise
        return Failed(entry, repr(exc))


def _classify(
    conn: Connection, plans: StepPlans, entry: StepEntry, latest: int, source: EpochSource, now: float
) -> Recovered:
    key = EntryKey(entry.task_id, entry.step_id, entry.entry_seq)
    marks = step_entries.markers(conn, key)
    task = tasks.find_task(conn, entry.task_id)
    plan = plans.get((entry.workflow_id, entry.step_id))
    declaration: tuple[ActionDecl, ...] = ()
    if task is None or plan is None:
        reason = "unresolvable"
    elif task.step_id != entry.step_id or task.workflow_id != entry.workflow_id:
        reason, declaration = "step_left", plan.step.events.on_enter
    elif latest != entry.entry_seq:  # the greatest over every entry of the pair, open or not
        reason, declaration = "superseded", plan.step.events.on_enter
    elif _clear_failed(marks, plan.step.events.on_enter):
        reason = "clear_failed"  # terminal as it stands: its later actions never reached a dispatcher (AC-C2)
    elif plan.deferred:
        return Deferred(entry, task)
    else:
        segment = Segment(task, plan.step, key, plan.order, plan.executors, check_digest=True, finish=True)
        return Dispatched(entry, task, run_segment(conn, segment, source, now, entry=entry, marks=marks))
    with savepoint(conn, "close"):
        close_entry(conn, key, declaration, reason, now)
        if reason != "clear_failed":  # a claim left by a dead runtime on a position no longer declared
            step_entries.skip_claimed_markers(conn, key, reason, now)
    return Closed(entry, reason)


def _clear_failed(marks: dict[int, Marker], declaration: tuple[ActionDecl, ...]) -> bool:
    return any(
        action.type == "clear_decisions" and position in marks and marks[position].state == "failed"
        for position, action in enumerate(declaration)
    )
