"""Code-review passes started by an on_enter run_code_review (on-enter-action-dispatch.md AC-A8).

A row is the artifact of "a review pass was started": the task, the step as workflow_step_id, and the
trigger `workflow_step`. A start the host refused stays recorded with status `start_failed`.
"""

from __future__ import annotations

import sqlite3


def record_review_run(conn: sqlite3.Connection, *, task_id: str, step_id: str, now: float) -> int:
    """Insert a `started` review run for (task, step); returns its id."""
    cur = conn.execute(
        "INSERT INTO task_review_runs (task_id, workflow_step_id, trigger, status, created_at)"
        " VALUES (?, ?, 'workflow_step', 'started', ?)",
        (task_id, step_id, now),
    )
    return int(cur.lastrowid or 0)


def mark_start_failed(conn: sqlite3.Connection, review_run_id: int, cause: str) -> None:
    conn.execute(
        "UPDATE task_review_runs SET status = 'start_failed', detail = ? WHERE id = ?", (cause, review_run_id)
    )
