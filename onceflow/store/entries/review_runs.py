"""Code-review passes started by an on_enter run_code_review (on-enter-action-dispatch.md AC-A8).

A row is the artifact of "a review pass was started": the task, the step as workflow_step_id, and the
trigger `workflow_step`. It also carries the entry identity (entry_seq, declared position) so that a launch
repeated after a crash (at-least-once, AC-A8) reuses the row, its id and counts `launches`, while a new
entry gets a new row: the row id is the stable review-run id a host deduplicates on. A start the host
refused stays recorded with status `start_failed`. Writer thread: every function runs inside the caller's
transaction.
"""

from __future__ import annotations

from typing import Any

from onceflow.protocol.results import ReviewRunInfo
from onceflow.protocol.times import rfc3339
from onceflow.store.backends.connection import Connection

_FIELDS = (
    "id",
    "task_id",
    "step_id",
    "entry_seq",
    "position",
    "agent_profile_id",
    "trigger",
    "status",
    "detail",
    "launches",
    "created_at",
)
_SELECT = "SELECT " + ", ".join("workflow_step_id" if f == "step_id" else f for f in _FIELDS)


def record_review_run(
    conn: Connection,
    *,
    task_id: str,
    step_id: str,
    entry_seq: int,
    position: int,
    agent_profile_id: str | None,
    now: float,
) -> int:
    """Record a launch of the review pass of entry (task, step, entry_seq) at `position`; returns its id.

    The first launch inserts a `started` row; a repeat (a recovery re-claim) returns the same id with
    `launches` + 1 and the row `started` again. `now` is Unix seconds.
    """
    row = conn.execute(
        "INSERT INTO task_review_runs (task_id, workflow_step_id, entry_seq, position, agent_profile_id,"
        " trigger, status, created_at) VALUES (?, ?, ?, ?, ?, 'workflow_step', 'started', ?)"
        " ON CONFLICT (task_id, workflow_step_id, entry_seq, position)"
        " DO UPDATE SET launches = task_review_runs.launches + 1, status = 'started', detail = ''"
        " RETURNING id",
        (task_id, step_id, entry_seq, position, agent_profile_id, now),
    ).fetchone()
    return int(row[0])


def mark_start_failed(conn: Connection, review_run_id: int, cause: str) -> None:
    conn.execute(
        "UPDATE task_review_runs SET status = 'start_failed', detail = ? WHERE id = ?", (cause, review_run_id)
    )


def list_review_runs(conn: Connection, *, task_id: str | None = None) -> list[ReviewRunInfo]:
    """Review runs (of one task, or all), oldest first, as replies show them; entry_seq and position are
    null for rows recorded before they were kept."""
    where, args = (" WHERE task_id = ?", (task_id,)) if task_id is not None else ("", ())
    return _infos(conn.execute(f"{_SELECT} FROM task_review_runs{where} ORDER BY id", args).fetchall())


def review_runs_page(
    conn: Connection, *, task_id: str | None, after_id: int | None, limit: int
) -> tuple[list[ReviewRunInfo], bool]:
    """Up to `limit` review runs (of one task, or all) with ids after `after_id` (None: from the first), in
    id order, and whether more follow (a page of `list_review_runs`)."""
    where, args = "id > ?", list[object]([after_id if after_id is not None else -1])
    if task_id is not None:
        where += " AND task_id = ?"
        args.append(task_id)
    rows = conn.execute(
        f"{_SELECT} FROM task_review_runs WHERE {where} ORDER BY id LIMIT ?", [*args, limit + 1]
    ).fetchall()
    return _infos(rows[:limit]), len(rows) > limit


def _infos(rows: list[Any]) -> list[ReviewRunInfo]:
    return [
        ReviewRunInfo(
            id=row[0],
            task_id=row[1],
            step_id=row[2],
            entry_seq=row[3],
            position=row[4],
            agent_profile_id=row[5],
            trigger=row[6],
            status=row[7],
            detail=row[8],
            launches=row[9],
            created_at=rfc3339(row[10]),
        )
        for row in rows
    ]
