"""The recovery scan's writer side: classify, close and re-dispatch the open entries of one request.
Writer thread: every function runs inside one store transaction, on step plans handed in by the Trio side
(actors/engine/recovery.py), and returns plain data for it to publish.

An entry the task has left is closed skipped(step_left); an older entry of a step the task re-entered is
closed skipped(superseded); an entry whose workflow or step no longer resolves is closed
skipped(unresolvable); an entry whose clear_decisions failed is closed as it stands; the rest are
re-dispatched (engine-owned actions only, terminal positions skipped, stale in_progress markers re-claimed
by epoch), set-oriented where the set path takes them (store/entries/recovery_set.py), else one by one, every
multi-write step in its own savepoint so a failing record rolls back alone. An entry with an action that
waits on the host is left to the Trio side (`Deferred`).

On PostgreSQL other runtimes may serve the same tasks meanwhile, so each batch first takes its tasks' locks
(store/backends/epochs.py `try_lock_tasks`: tried, never waited for) and reads its entries again under them:
an entry whose task another runtime's transaction holds is left to the Trio side (`Busy`), which recovers it
alone once that lock is free; one another runtime finished meanwhile is dropped; the rest are decided as on
SQLite, with the greatest entry_seq of their pair as it stands now, and no command of their task runs in
between. Which runtime runs each engine action of an entry it finds half done is decided, as everywhere, by
the markers' compare-and-set with epochs. Source: on-enter-action-dispatch.md, "Recovery" and AC-B9.
"""

from __future__ import annotations

import attrs

from onceflow.protocol.workflow import ActionDecl
from onceflow.store.backends import epochs, faults
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.epochs import EpochSource
from onceflow.store.backends.savepoint import savepoint
from onceflow.store.backends.urls import on_postgres
from onceflow.store.entries import step_entries
from onceflow.store.entries.recovery_set import SetRun, StepPlans, finish_common, plan_common
from onceflow.store.entries.segment import Segment, SegmentResult, close_entry, run_segment
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.records import Marker, StepEntry, TaskRecord
from onceflow.store.tasks import tasks

BATCH_SIZE = 1024
"""Entries planned and classified together (the set path's query per step covers a batch), and about the
most entries a store request decides one by one (the per-entry path holds their events until published)."""

REQUEST_SIZE = 16 * BATCH_SIZE
"""The most entries one store request (one transaction) covers. A request takes batch after batch until it
has decided `BATCH_SIZE` entries one by one or covered this many: the set path's entries cost little to
hold, and every request costs a commit (an fsync at FULL) and two thread hand-offs, which on a loaded
machine cost more than the set statements (bench/README.md)."""


LOCKED_REQUEST_SIZE = 512
"""The most entries one store request covers on PostgreSQL (one batch): the request holds a lock per task of
its entries until its commit, PostgreSQL's shared lock table holds about max_locks_per_transaction (64) x
max_connections locks for every session together, and a command of one of those tasks in another runtime
waits for that commit (bench/recovery.py --db postgres: ~0.2 s a request)."""


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


@attrs.frozen
class Busy:
    """An entry whose task's lock another runtime held (PostgreSQL): not looked at, to recover alone once
    that lock is free; `latest` as it was given."""

    entry: StepEntry
    latest: int


Recovered = Closed | Dispatched | Deferred | Failed | SetRun | Busy


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
        covered += len(batch)
        if on_postgres(conn):
            batch, busy = _under_task_locks(conn, batch)
            recovered.extend(busy)
        done = _recover_batch(conn, plans, batch, source, now, audience)
        one_by_one += sum(not isinstance(item, SetRun) for item in done)
        recovered.extend(done)
    return recovered, covered


def _under_task_locks(
    conn: Connection, batch: list[tuple[StepEntry, int]]
) -> tuple[list[tuple[StepEntry, int]], list[Busy]]:
    """PostgreSQL: take the locks of the batch's tasks (tried, never waited for) and read the entries again
    under them, in one round trip (two statements: the second one's snapshot, taken after the first ended,
    sees every commit of a transaction that held one of these locks). Returns the entries still open whose
    task's lock is held, each with its pair's greatest entry_seq now, and the entries whose task's lock
    another runtime holds (`Busy`); an entry found terminal was finished by another runtime meanwhile."""
    locks = epochs.try_lock_tasks(conn, list(dict.fromkeys(entry.task_id for entry, _ in batch)))
    still_open = conn.execute(
        "SELECT u.n, (SELECT MAX(later.entry_seq) FROM step_entries AS later"
        "  WHERE later.task_id = u.task_id AND later.step_id = u.step_id)"
        " FROM unnest(CAST(? AS text[]), CAST(? AS text[]), CAST(? AS bigint[]))"
        " WITH ORDINALITY AS u(task_id, step_id, entry_seq, n)"
        " JOIN step_entries AS e ON e.task_id = u.task_id AND e.step_id = u.step_id"
        " AND e.entry_seq = u.entry_seq WHERE e.terminal = 0",
        (
            [entry.task_id for entry, _ in batch],
            [entry.step_id for entry, _ in batch],
            [entry.entry_seq for entry, _ in batch],
        ),
    ).fetchall()
    held = {task_id for task_id, ok in locks.fetchall() if ok}
    latest = {int(n) - 1: int(seq) for n, seq in still_open}
    mine = [
        (entry, latest[index])
        for index, (entry, _) in enumerate(batch)
        if entry.task_id in held and index in latest
    ]
    busy = [Busy(entry, seq) for entry, seq in batch if entry.task_id not in held]
    return mine, busy


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
    plan = plans.get((entry.workflow_id, entry.step_id, entry.workflow_version))
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
