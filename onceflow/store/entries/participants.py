"""Participant rows (template-level and per-task), the seat rule of a fan-out, and the decisions recorded
against them. Writer thread: every function runs inside the caller's transaction."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from onceflow.protocol.errors import NotFoundError
from onceflow.protocol.results import DecisionInfo
from onceflow.protocol.times import rfc3339
from onceflow.store.backends.connection import Connection
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
    conn: Connection,
    *,
    workflow_id: str,
    step_id: str,
    task_id: str | None,
    role: str,
    agent_profile_id: str,
    decision_required: bool,
    position: int,
) -> int:
    """`seat_participant`'s row id (idempotent: an identical row is not added twice)."""
    return seat_participant(
        conn,
        workflow_id=workflow_id,
        step_id=step_id,
        task_id=task_id,
        role=role,
        agent_profile_id=agent_profile_id,
        decision_required=decision_required,
        position=position,
    )[0]


def seat_participant(
    conn: Connection,
    *,
    workflow_id: str,
    step_id: str,
    task_id: str | None,
    role: str,
    agent_profile_id: str,
    decision_required: bool,
    position: int,
) -> tuple[int, bool]:
    """Insert a participant row (`task_id` None: template-level) unless an identical one exists (every
    field equal: the same seat sent again); returns (its id, whether it already existed). Rows that differ
    in any field (another position, say) are separate seats, agentless ones included."""
    scope = "task_id IS NULL" if task_id is None else "task_id = ?"
    found = conn.execute(
        f"SELECT id FROM participants WHERE workflow_id = ? AND step_id = ? AND {scope} AND role = ?"
        " AND agent_profile_id = ? AND decision_required = ? AND position = ? ORDER BY id LIMIT 1",
        [
            workflow_id,
            step_id,
            *([] if task_id is None else [task_id]),
            role,
            agent_profile_id,
            int(decision_required),
            position,
        ],
    ).fetchone()
    if found is not None:
        return int(found[0]), True
    cur = conn.execute(
        "INSERT INTO participants (workflow_id, step_id, task_id, role, agent_profile_id, decision_required,"
        " position) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
        (workflow_id, step_id, task_id, role, agent_profile_id, int(decision_required), position),
    )
    return int(cur.fetchone()[0]), False


def remove_participant(conn: Connection, participant_id: int) -> bool:
    return conn.execute("DELETE FROM participants WHERE id = ?", (participant_id,)).rowcount == 1


def participants_for_task(conn: Connection, *, workflow_id: str, task_id: str) -> list[Participant]:
    """In one query: the task's per-task rows (any step) and its workflow's template rows (any step).

    Read once per action, so a concurrent add/remove never splits a fan-out (on-enter spec AC-F2).
    """
    rows = conn.execute(
        f"SELECT {_P_COLUMNS} FROM participants WHERE task_id = ? OR (task_id IS NULL AND workflow_id = ?)"
        " ORDER BY role, position, id",
        (task_id, workflow_id),
    ).fetchall()
    return [_participant(row) for row in rows]


def task_participants(conn: Connection, task_id: str) -> list[Participant]:
    """`participants_for_task` of an existing task. Raises NotFoundError (field task_id) when it does not
    exist."""
    row = conn.execute("SELECT workflow_id FROM tasks WHERE id = ?", (task_id,)).fetchone()
    if row is None:
        raise NotFoundError(f"task {task_id!r} does not exist", field="task_id")
    return participants_for_task(conn, workflow_id=row[0], task_id=task_id)


def template_participants(conn: Connection, *, workflow_id: str, step_id: str) -> list[Participant]:
    """The template-level rows of one step in (role, position, id) order: what `participants_for_task` gives
    at that step for a task with no per-task rows."""
    rows = conn.execute(
        f"SELECT {_P_COLUMNS} FROM participants WHERE task_id IS NULL AND workflow_id = ? AND step_id = ?"
        " ORDER BY role, position, id",
        (workflow_id, step_id),
    ).fetchall()
    return [_participant(row) for row in rows]


def record_decision(
    conn: Connection,
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
        " comment, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
        (task_id, step_id, participant_id, role, decider_type, decider_id, decision, comment, now),
    )
    return int(cur.fetchone()[0])


def decision_receipt(
    conn: Connection, *, task_id: str, step_id: str, external_id: str
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
    conn: Connection,
    *,
    task_id: str,
    step_id: str,
    external_id: str,
    decision_id: int,
    content: str,
    now: float,
) -> None:
    """Keep the receipt of a decision the host sent under `external_id` (recorded at `now`, Unix seconds:
    retention deletes it once older than the retention, store/retention/retention.py)."""
    conn.execute(
        "INSERT INTO decision_receipts (task_id, step_id, external_id, decision_id, content, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (task_id, step_id, external_id, decision_id, content, now),
    )


def decisions_for(conn: Connection, *, task_id: str, step_id: str | None = None) -> list[Decision]:
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


def decisions_page(
    conn: Connection, *, task_id: str | None, step_id: str | None = None, after_id: int | None, limit: int
) -> tuple[list[Decision], bool]:
    """Up to `limit` decisions (of a task, optionally one step; None: of every task) with ids after
    `after_id` (None: from the first), in id order (oldest first), and whether more follow (a page of
    `list_decisions`)."""
    clauses, args = ["id > ?"], list[object]([after_id if after_id is not None else -1])
    for column, value in (("task_id", task_id), ("step_id", step_id)):
        if value is not None:
            clauses.append(f"{column} = ?")
            args.append(value)
    rows = conn.execute(
        f"SELECT {_D_COLUMNS} FROM decisions WHERE {' AND '.join(clauses)} ORDER BY id LIMIT ?",
        [*args, limit + 1],
    ).fetchall()
    return [_decision(row) for row in rows[:limit]], len(rows) > limit


def clear_decisions(conn: Connection, *, task_id: str, step_id: str) -> int:
    """Delete every decision of (task, step) in ONE statement; returns the count.

    A single DELETE is the linearization point against concurrent recording (on-enter spec AC-F3).
    """
    return conn.execute(
        "DELETE FROM decisions WHERE task_id = ? AND step_id = ?", (task_id, step_id)
    ).rowcount


def step_participants(
    conn: Connection, *, workflow_id: str, task_id: str, step_id: str, role: str
) -> list[Participant]:
    """The merged template + per-task rows of `role` at `step_id`, in (role, position, id) order."""
    rows = participants_for_task(conn, workflow_id=workflow_id, task_id=task_id)
    return [p for p in rows if p.workflow_id == workflow_id and p.step_id == step_id and p.role == role]


def seats_and_decisions(
    conn: Connection, *, workflow_id: str, task_id: str, step_id: str
) -> tuple[list[Participant], list[Decision]]:
    """What a quorum guard is evaluated over: the task's participant rows and its decisions at `step_id`."""
    rows = participants_for_task(conn, workflow_id=workflow_id, task_id=task_id)
    return rows, decisions_for(conn, task_id=task_id, step_id=step_id)


def dedupe_seats(rows: Iterable[Participant]) -> list[Participant]:
    """One row per (role, agent), the per-task row winning a collision, else the first in (position, id)
    order, kept in (role, position, id) order; rows without an agent are never merged (each is its own
    failure). The seat rule of a fan-out (on-enter-action-dispatch.md AC-A5, AC-E2); `SEATS_SQL` is the
    same rule inside a statement."""
    ordered = list(rows)
    winners: dict[tuple[str, str], Participant] = {}
    for row in ordered:
        pair = (row.role, row.agent_profile_id)
        if row.agent_profile_id and (pair not in winners or (winners[pair].task_id is None and row.task_id)):
            winners[pair] = row
    return [
        row for row in ordered if not row.agent_profile_id or winners[(row.role, row.agent_profile_id)] is row
    ]


def seats_sql(*, workflow: str, step: str, task: str, role: str) -> str:
    """A FROM-clause fragment `participants AS p ... WHERE ...` selecting `dedupe_seats` of the rows of
    `role` at `step` of `workflow`, template or `task`'s own, as the join partner of the preceding table
    (`... {Dialect.join} <this>`); each argument is an SQL expression. A seat without an agent stays (its run
    must fail the statement)."""
    mine = f"(p.task_id IS NULL OR p.task_id = {task})"
    theirs = f"(q.task_id IS NULL OR q.task_id = {task})"
    return (
        f"participants AS p ON p.workflow_id = {workflow} AND p.step_id = {step} AND p.role = {role}"
        f" AND {mine} WHERE p.agent_profile_id = '' OR NOT EXISTS (SELECT 1 FROM participants AS q"
        f" WHERE q.workflow_id = {workflow} AND q.step_id = {step} AND q.role = p.role"
        f" AND q.agent_profile_id = p.agent_profile_id AND {theirs}"
        " AND (CASE WHEN q.task_id IS NULL THEN 1 ELSE 0 END, q.position, q.id)"
        " < (CASE WHEN p.task_id IS NULL THEN 1 ELSE 0 END, p.position, p.id))"
    )


def decision_info(decision: Decision) -> DecisionInfo:
    """A recorded decision as replies show it."""
    return DecisionInfo(
        id=decision.id,
        task_id=decision.task_id,
        step_id=decision.step_id,
        participant_id=decision.participant_id,
        role=decision.role,
        decider_type=decision.decider_type,
        decider_id=decision.decider_id,
        decision=decision.decision,
        comment=decision.comment,
        created_at=rfc3339(decision.created_at),
    )


def decisions_of(conn: Connection, *, task_id: str, step_id: str | None = None) -> list[DecisionInfo]:
    """`decisions_for` as replies show them (`list_decisions`)."""
    return [decision_info(d) for d in decisions_for(conn, task_id=task_id, step_id=step_id)]
