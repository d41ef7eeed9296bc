"""Participant rows (template-level and per-task) and the decisions recorded against them."""

from __future__ import annotations

import sqlite3
from typing import Any

from onceflow.store.records import Decision, Participant

_P_COLUMNS = "id, workflow_id, step_id, task_id, role, agent_profile_id, decision_required, position"
_D_COLUMNS = (
    "id, task_id, step_id, participant_id, role, decider_type, decider_id, decision, comment, created_at"
)


def _participant(row: tuple[Any, ...]) -> Participant:
    return Participant(
        id=row[0],
        workflow_id=row[1],
        step_id=row[2],
        task_id=row[3],
        role=row[4],
        agent_profile_id=row[5],
        decision_required=bool(row[6]),
        position=row[7],
    )


def _decision(row: tuple[Any, ...]) -> Decision:
    return Decision(
        id=row[0],
        task_id=row[1],
        step_id=row[2],
        participant_id=row[3],
        role=row[4],
        decider_type=row[5],
        decider_id=row[6],
        decision=row[7],
        comment=row[8],
        created_at=row[9],
    )


def add_participant(
    conn: sqlite3.Connection,
    *,
    workflow_id: str,
    step_id: str,
    task_id: str | None,
    role: str,
    agent_profile_id: str,
    decision_required: bool,
    position: int,
) -> int:
    """Insert a participant row; `task_id` None makes it template-level. Returns the new id."""
    cur = conn.execute(
        "INSERT INTO participants (workflow_id, step_id, task_id, role, agent_profile_id, decision_required,"
        " position) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (workflow_id, step_id, task_id, role, agent_profile_id, int(decision_required), position),
    )
    return int(cur.lastrowid or 0)


def remove_participant(conn: sqlite3.Connection, participant_id: int) -> bool:
    return conn.execute("DELETE FROM participants WHERE id = ?", (participant_id,)).rowcount == 1


def participants_for_task(conn: sqlite3.Connection, *, workflow_id: str, task_id: str) -> list[Participant]:
    """In one query: the task's per-task rows (any step) and its workflow's template rows (any step).

    Read once per action, so a concurrent add/remove never splits a fan-out (on-enter spec AC-F2).
    """
    rows = conn.execute(
        f"SELECT {_P_COLUMNS} FROM participants WHERE task_id = ? OR (task_id IS NULL AND workflow_id = ?)"
        " ORDER BY role, position, id",
        (task_id, workflow_id),
    ).fetchall()
    return [_participant(row) for row in rows]


def template_participants(conn: sqlite3.Connection, *, workflow_id: str, step_id: str) -> list[Participant]:
    """The template-level rows of one step in (role, position, id) order: what `participants_for_task` gives
    at that step for a task with no per-task rows."""
    rows = conn.execute(
        f"SELECT {_P_COLUMNS} FROM participants WHERE task_id IS NULL AND workflow_id = ? AND step_id = ?"
        " ORDER BY role, position, id",
        (workflow_id, step_id),
    ).fetchall()
    return [_participant(row) for row in rows]


def record_decision(
    conn: sqlite3.Connection,
    *,
    task_id: str,
    step_id: str,
    participant_id: int | None,
    role: str,
    decider_type: str,
    decider_id: str,
    decision: str,
    comment: str,
    now: float,
) -> int:
    """Insert a decision row; returns its id."""
    cur = conn.execute(
        "INSERT INTO decisions (task_id, step_id, participant_id, role, decider_type, decider_id, decision,"
        " comment, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (task_id, step_id, participant_id, role, decider_type, decider_id, decision, comment, now),
    )
    return int(cur.lastrowid or 0)


def decision_receipt(
    conn: sqlite3.Connection, *, task_id: str, step_id: str, external_id: str
) -> tuple[int, str] | None:
    """(decision row id, content) first recorded under the host's `external_id`, or None.

    Receipts outlive clear_decisions, so a decision redelivered after a restart (the ledger starts empty) is
    recognised and never counted in a later round. `content` is the canonical JSON of what was decided (a
    reused id with another verdict is a conflict, not a replay); '' for a receipt written before it was kept.
    """
    row = conn.execute(
        "SELECT decision_id, content FROM decision_receipts"
        " WHERE task_id = ? AND step_id = ? AND external_id = ?",
        (task_id, step_id, external_id),
    ).fetchone()
    return None if row is None else (int(row[0]), str(row[1]))


def add_decision_receipt(
    conn: sqlite3.Connection, *, task_id: str, step_id: str, external_id: str, decision_id: int, content: str
) -> None:
    conn.execute(
        "INSERT INTO decision_receipts (task_id, step_id, external_id, decision_id, content)"
        " VALUES (?, ?, ?, ?, ?)",
        (task_id, step_id, external_id, decision_id, content),
    )


def decisions_for(conn: sqlite3.Connection, *, task_id: str, step_id: str | None = None) -> list[Decision]:
    """Decisions of a task (optionally one step), oldest first."""
    if step_id is None:
        rows = conn.execute(
            f"SELECT {_D_COLUMNS} FROM decisions WHERE task_id = ? ORDER BY created_at, id", (task_id,)
        )
    else:
        rows = conn.execute(
            f"SELECT {_D_COLUMNS} FROM decisions WHERE task_id = ? AND step_id = ? ORDER BY created_at, id",
            (task_id, step_id),
        )
    return [_decision(row) for row in rows.fetchall()]


def clear_decisions(conn: sqlite3.Connection, *, task_id: str, step_id: str) -> int:
    """Delete every decision of (task, step) in ONE statement; returns the count.

    A single DELETE is the linearization point against concurrent recording (on-enter spec AC-F3).
    """
    return conn.execute(
        "DELETE FROM decisions WHERE task_id = ? AND step_id = ?", (task_id, step_id)
    ).rowcount
