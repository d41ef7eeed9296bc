"""WIP-limit bookkeeping on task rows: occupancy and the promotion claims.

A slot at a step is taken by a task there with `wip_admitted` set; queued tasks take none. Every claim
re-counts inside its transaction and updates only a row still in its expected state, so one task is never
promoted twice. Source: kandev-engine-notes.md, "WIP limits (entry path E3)".

Several runtimes on one PostgreSQL database: two transactions admitting different tasks into one step would
each count the other's admission as not yet committed and both see room. `has_room` therefore first takes a
transaction-scoped advisory lock keyed by (workflow, step) (`serialize_admissions`), held until the admitting
transaction commits, so the count it reads includes every admission committed before and none can commit in
between. SQLite needs none: its one writer already serializes every transaction.
"""

from __future__ import annotations

import sqlite3

from onceflow.store.urls import on_postgres

# Candidate order: position, priority critical > high > medium > low, queued_at, created_at, id.
_ORDER = (
    " ORDER BY position, CASE priority WHEN 'critical' THEN 0 WHEN 'high' THEN 1 WHEN 'medium' THEN 2"
    " ELSE 3 END, queued_at, created_at, id LIMIT 1"
)


def occupancy(
    conn: sqlite3.Connection, workflow_id: str, step_id: str, *, excluding: str | None = None
) -> int:
    """Admitted tasks at the step, not counting `excluding` (a task being moved does not block itself)."""
    (count,) = conn.execute(
        "SELECT COUNT(*) FROM tasks WHERE workflow_id = ? AND workflow_step_id = ? AND wip_admitted = 1"
        " AND id IS NOT ?",
        (workflow_id, step_id, excluding),
    ).fetchone()
    return int(count)


WIP_NAMESPACE = 0x7769  # 'wi': the first key of every step's admission lock (tasks use store.epochs' 0x6F66)


def serialize_admissions(conn: sqlite3.Connection, workflow_id: str, step_id: str) -> None:
    """On PostgreSQL, wait for the (workflow, step) admission lock, held until `conn`'s transaction ends;
    nothing on SQLite. Two steps whose keys hash alike share a lock, which only serializes more.

    Raises:
        sqlite3.OperationalError: the wait exceeded the lock timeout, or PostgreSQL broke a deadlock with
            it (both SQLITE_BUSY: the store answers `storage_busy`, retryable).
    """
    if on_postgres(conn):
        conn.execute(
            "SELECT pg_advisory_xact_lock(?, hashtext(?))", (WIP_NAMESPACE, f"{workflow_id}\t{step_id}")
        )


def has_room(
    conn: sqlite3.Connection,
    workflow_id: str,
    step_id: str,
    limit: int,
    *,
    excluding: str | None = None,
    serialize: bool = True,
) -> bool:
    """Whether the step admits one more task; a limit <= 0 is unlimited. For a limited step, on PostgreSQL,
    first takes the step's admission lock (`serialize_admissions`) unless `serialize` is False (a caller
    that only reads whether the step is full, admitting nothing into it)."""
    if limit <= 0:
        return True
    if serialize:
        serialize_admissions(conn, workflow_id, step_id)
    return occupancy(conn, workflow_id, step_id, excluding=excluding) < limit


def queued_in_place(conn: sqlite3.Connection, workflow_id: str, step_id: str) -> str | None:
    """The next task waiting at `step_id` for `step_id` itself, if any."""
    row = conn.execute(
        "SELECT id FROM tasks WHERE workflow_id = ? AND workflow_step_id = ? AND wip_admitted = 0"
        " AND queued_for_step_id = ?" + _ORDER,
        (workflow_id, step_id, step_id),
    ).fetchone()
    return row[0] if row else None


def feeder_candidate(
    conn: sqlite3.Connection, workflow_id: str, feeder_id: str, target_id: str
) -> str | None:
    """The next task admitted at the feeder that may be pulled into `target_id`."""
    row = conn.execute(
        "SELECT id FROM tasks WHERE workflow_id = ? AND workflow_step_id = ? AND wip_admitted = 1"
        " AND (queued_for_step_id IS NULL OR queued_for_step_id = ?)" + _ORDER,
        (workflow_id, feeder_id, target_id),
    ).fetchone()
    return row[0] if row else None


def occupied_steps(conn: sqlite3.Connection) -> set[tuple[str, str, bool]]:
    """Where tasks stand, one read: (workflow id, step id, admitted?) for every step holding any task."""
    rows = conn.execute("SELECT DISTINCT workflow_id, workflow_step_id, wip_admitted FROM tasks").fetchall()
    return {(workflow_id, step_id, bool(admitted)) for workflow_id, step_id, admitted in rows}


def admit(
    conn: sqlite3.Connection,
    *,
    task_id: str,
    from_step_id: str,
    expected_admitted: bool,
    step_id: str,
    queued_for_step_id: str | None,
    now: float,
) -> bool:
    """Claim one promotion: only a row still at `from_step_id` with the expected admitted flag moves, and
    its admission counter goes up by one (a promotion is a step entry)."""
    cur = conn.execute(
        "UPDATE tasks SET workflow_step_id = ?, wip_admitted = 1, queued_for_step_id = ?,"
        " queued_at = CASE WHEN ? IS NULL THEN NULL ELSE queued_at END, updated_at = ?,"
        " admissions = admissions + 1"
        " WHERE id = ? AND workflow_step_id = ? AND wip_admitted = ?",
        (step_id, queued_for_step_id, queued_for_step_id, now, task_id, from_step_id, int(expected_admitted)),
    )
    return cur.rowcount == 1
