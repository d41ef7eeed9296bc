"""Code-review passes started by an on_enter run_code_review (on-enter-action-dispatch.md AC-A8).

A row is the artifact of "a review pass was started": the task, the step as workflow_step_id, and the
trigger `workflow_step`. It also carries the entry identity (entry_seq, declared position) so that a launch
repeated after a crash (at-least-once, AC-A8) reuses the row, its id and counts `launches`, while a new
entry gets a new row: the row id is the stable review-run id a host deduplicates on.
A start the host refused stays recorded with status `start_failed`.
"""

from __future__ import annotations

import sqlite3
from typing import Any

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
    conn: sqlite3.Connection,
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


def mark_start_failed(conn: sqlite3.Connection, review_run_id: int, cause: str) -> None:
    conn.execute(
        "UPDATE task_review_runs SET status = 'start_failed', detail = ? WHERE id = ?", (cause, review_run_id)
    )


def list_review_runs(conn: sqlite3.Connection, *, task_id: str | None = None) -> list[dict[str, Any]]:
    """Review runs (of one task, or all), oldest first, as JSON-ready mappings: id (the review-run id),
    task_id, step_id, entry_seq, position, agent_profile_id, trigger, status, detail, launches, created_at.
    entry_seq and position are null for rows recorded before they were kept."""
    where, args = (" WHERE task_id = ?", (task_id,)) if task_id is not None else ("", ())
    rows = conn.execute(f"{_SELECT} FROM task_review_runs{where} ORDER BY id", args).fetchall()
    return [dict(zip(_FIELDS, row, strict=True)) for row in rows]
