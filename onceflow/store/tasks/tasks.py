"""Task rows: create, read, update and the compare-and-set step change.

Writer thread: every function runs inside the caller's transaction (store/writer.py).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from typing import Any

from onceflow.protocol.commands import CreateTask, Priority
from onceflow.protocol.errors import ConflictError, NotFoundError
from onceflow.protocol.results import TaskInfo
from onceflow.protocol.workflow import Step
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.urls import on_postgres
from onceflow.store.entries import wip
from onceflow.store.records import TaskRecord
from onceflow.store.runs import run_claims
from onceflow.store.runs.runs import Change
from onceflow.store.tasks import history

NEWEST_VERSION = "(SELECT COALESCE(MAX(version), 1) FROM workflow_versions WHERE workflow_id = {workflow})"
"""The newest registered version of the workflow the SQL expression `{workflow}` names: the version a task
switched to another workflow is pinned to (a move within its workflow keeps its version)."""

TASK_COLUMNS = (
    # every column a TaskRecord is read from, in `task_from_row` order
    "id, workflow_id, workflow_step_id, title, session_id, primary_agent_id, ceo_agent_id, priority,"
    " wip_admitted, queued_for_step_id, created_at, updated_at, admissions,"
    " workflow_version"
)


def task_from_row(row: sqlite3.Row | tuple[Any, ...]) -> TaskRecord:
    """A TaskRecord from a row selected as `TASK_COLUMNS`."""
    return TaskRecord(
        id=row[0],
        workflow_id=row[1],
        step_id=row[2],
        title=row[3],
        session_id=row[4],
        primary_agent_id=row[5],
        ceo_agent_id=row[6],
        priority=row[7],
        wip_admitted=bool(row[8]),
        queued_for_step_id=row[9],
        created_at=row[10],
        updated_at=row[11],
        admissions=row[12],
        workflow_version=row[13],
    )


def find_task(conn: Connection, task_id: str) -> TaskRecord | None:
    row = conn.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE id = ?", (task_id,)).fetchone()
    return task_from_row(row) if row else None


_TASKS = f"SELECT {TASK_COLUMNS} FROM tasks WHERE id IN (SELECT value FROM json_each(?))"
_TASKS_PG = f"SELECT {TASK_COLUMNS} FROM tasks WHERE id = ANY(?)"


def get_tasks(conn: Connection, task_ids: list[str]) -> list[TaskRecord] | None:
    """`get_task` of every id in one statement, in order: the writer's grouped reads (store/writer.py
    `Grouped`, one statement for a batch's reads instead of one each). None when one does not exist: each
    is then read alone, and the missing one raises there."""
    if on_postgres(conn):
        found = conn.execute(_TASKS_PG, (task_ids,)).fetchall()
    else:
        found = conn.execute(_TASKS, (json.dumps(task_ids),)).fetchall()
    rows = {row[0]: row for row in found}
    if not rows.keys() >= set(task_ids):
        return None
    return [task_from_row(rows[task_id]) for task_id in task_ids]


def list_tasks(conn: Connection, *, after_task_id: str | None, limit: int) -> tuple[list[TaskRecord], bool]:
    """Up to `limit` tasks with ids after `after_task_id` (None: from the first), in id order, and whether
    more follow (a page of `list_tasks`)."""
    rows = conn.execute(
        f"SELECT {TASK_COLUMNS} FROM tasks WHERE id > ? ORDER BY id LIMIT ?", (after_task_id or "", limit + 1)
    ).fetchall()
    return [task_from_row(row) for row in rows[:limit]], len(rows) > limit


def get_task(conn: Connection, task_id: str) -> TaskRecord:
    """The task row. Raises NotFoundError (field task_id) when it does not exist."""
    task = find_task(conn, task_id)
    if task is None:
        raise NotFoundError(f"task {task_id!r} does not exist", field="task_id")
    return task


_INSERT_TASK = (
    "INSERT INTO tasks (id, workflow_id, workflow_step_id, title, session_id, primary_agent_id,"
    " ceo_agent_id, priority, wip_admitted, queued_for_step_id, queued_at, created_at, updated_at,"
    " workflow_version) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING"
)


def insert_task(
    conn: Connection,
    *,
    task_id: str,
    workflow_id: str,
    step_id: str,
    title: str,
    session_id: str | None,
    primary_agent_id: str | None,
    ceo_agent_id: str | None,
    priority: Priority,
    now: float,
    admitted: bool = True,
    queued_for_step_id: str | None = None,
    workflow_version: int = 1,
) -> TaskRecord:
    """Insert a task at `step_id` of version `workflow_version` of its workflow, admitted or (with
    `admitted` False) queued there; `queued_for_step_id` names the step it waits for; returns its row as
    stored (built from what was inserted: every other column is at its default, no admission yet). One
    statement, no read back: an id already taken inserts nothing. Raises ConflictError (field task_id) if
    the id is taken."""
    row = (
        task_id,
        workflow_id,
        step_id,
        title,
        session_id,
        primary_agent_id,
        ceo_agent_id,
        priority,
        int(admitted),
        queued_for_step_id,
        None if queued_for_step_id is None else now,
        now,
        now,
        workflow_version,
    )
    if conn.execute(_INSERT_TASK, row).rowcount != 1:
        raise ConflictError(f"task {task_id!r} already exists", field="task_id")
    return _inserted(row)


def _inserted(row: tuple[Any, ...]) -> TaskRecord:
    """The task row as stored by `_INSERT_TASK` with parameters `row`: every other column at its default."""
    (
        task_id,
        workflow_id,
        step_id,
        title,
        session_id,
        primary,
        ceo,
        priority,
        admitted,
        queued_for,
        _,
        now,
        _,
        version,
    ) = row
    return TaskRecord(
        task_id,
        workflow_id,
        step_id,
        title,
        session_id,
        primary,
        ceo,
        priority,
        bool(admitted),
        queued_for,
        now,
        now,
        0,
        version,
    )


def create_task(
    conn: Connection,
    command: CreateTask,
    workflow_id: str,
    target: Step,
    feeder: Step | None,
    now: float,
    workflow_version: int = 1,
) -> TaskRecord:
    """Insert the task `command` creates where `wip.place` lands it at `target` of `workflow_id`, pinned to
    `workflow_version` (the newest: the one `target` is a step of; a creation is not a step entry):
    admitted there, queued there when it is full, or admitted at its `feeder` tagged for it; its history
    starts with a `created` item (store/tasks/history.py). Takes the command whole: a store request's keyword
    arguments cost a dict on the way to the writer thread.

    Raises:
        WipLimitError: `target` and its feeder are both full (field step_id).
        ConflictError: the task id is taken (field task_id).
    """
    placement = wip.place(conn, workflow_id, target, feeder=feeder)
    task = insert_task(
        conn,
        task_id=command.task_id,
        workflow_id=workflow_id,
        step_id=placement.step_id,
        title=command.title,
        session_id=command.session_id,
        primary_agent_id=command.primary_agent_id,
        ceo_agent_id=command.ceo_agent_id,
        priority=command.priority,
        now=now,
        admitted=placement.admitted,
        queued_for_step_id=placement.queued_for,
        workflow_version=workflow_version,
    )
    detail = history.created_detail(workflow_id, workflow_version, placement.step_id, not placement.admitted)
    history.record_detail(conn, task.id, now, "created", detail)
    return task


def create_tasks(
    conn: Connection, items: list[tuple[CreateTask, float, str, Step, int]]
) -> list[TaskRecord] | None:
    """`create_task` of each (command, now, workflow id, target, workflow version) of `items`, all of one
    workflow, version and `target` (a step without a WIP limit: every task is admitted there, no placement
    to read), with two statements run for all of them (the writer's `Grouped`: one batch's creations into
    one step together): the rows, then their `created` history items. Each task's row is the one
    `create_task` would return. None when a task id is taken (or given twice): the writer then rolls the
    group back and each creation runs alone, the taken one raising its ConflictError there."""
    _, _, workflow_id, target, workflow_version = items[0]
    step_id = target.id
    rows = [
        (
            command.task_id,
            workflow_id,
            step_id,
            command.title,
            command.session_id,
            command.primary_agent_id,
            command.ceo_agent_id,
            command.priority,
            1,
            None,
            None,
            now,
            now,
            workflow_version,
        )
        for command, now, *_ in items
    ]
    if conn.executemany(_INSERT_TASK, rows).rowcount != len(rows):
        return None
    detail = history.created_detail(workflow_id, workflow_version, step_id, queued=False)
    history.record_many(conn, [(row[0], row[11], "created", detail) for row in rows])
    return [_inserted(row) for row in rows]


def move_task_step(
    conn: Connection,
    *,
    task_id: str,
    expected_step_id: str,
    workflow_id: str,
    step_id: str,
    now: float,
    admitted: bool = True,
    version: tuple[str, bool, int] | None = None,
) -> bool:
    """Compare-and-set the task's step: only if it is still at `expected_step_id` (and, given `version`,
    still has that workflow id, admitted flag and admission count: a cached row verified). True when it
    moved.

    Admitted, the task occupies `step_id` (queue fields cleared) and its admission counter goes up by one
    (a step entry); not admitted, it waits there queued for it (a queued placement at a step at its WIP
    limit: not an entry). A move to another workflow pins the task to that workflow's newest version
    (`NEWEST_VERSION`); a move within its workflow keeps its version.
    """
    queued_for, queued_at = (None, None) if admitted else (step_id, now)
    params: tuple[Any, ...] = (
        workflow_id,
        step_id,
        int(admitted),
        queued_for,
        queued_at,
        now,
        int(admitted),
        task_id,
        expected_step_id,
    )
    if version is None:
        return conn.execute(_MOVE, params).rowcount == 1
    return conn.execute(_MOVE_VERSION, (*params, version[0], int(version[1]), version[2])).rowcount == 1


_MOVE = (
    "UPDATE tasks SET workflow_version = CASE WHEN workflow_id = ?1 THEN workflow_version ELSE"
    f" {NEWEST_VERSION.format(workflow='?1')} END,"
    " workflow_id = ?1, workflow_step_id = ?2, wip_admitted = ?3,"
    " queued_for_step_id = ?4, queued_at = ?5, updated_at = ?6, admissions = admissions + ?7"
    " WHERE id = ?8 AND workflow_step_id = ?9"
)
_MOVE_VERSION = _MOVE + " AND workflow_id = ?10 AND wip_admitted = ?11 AND admissions = ?12"
"""A cached row's compare-and-set: `_MOVE` verifying the row's workflow, admitted flag and admission count
too (both spelled out once, so no call concatenates them: this runs for every entry in the writer thread)."""


def update_task_fields(conn: Connection, task_id: str, fields: dict[str, Any], now: float) -> None:
    """Update plain task columns (title, priority, session_id, primary_agent_id); never the step."""
    allowed = {"title", "priority", "session_id", "primary_agent_id"}
    unknown = set(fields) - allowed
    if unknown:
        raise ValueError(f"not updatable here: {sorted(unknown)}")
    if not fields:
        return
    assignments = ", ".join(f"{name} = ?" for name in fields)
    conn.execute(
        f"UPDATE tasks SET {assignments}, updated_at = ? WHERE id = ?", (*fields.values(), now, task_id)
    )


def update_task(conn: Connection, task_id: str, fields: dict[str, Any], now: float) -> None:
    """`update_task_fields` of an existing task. Raises NotFoundError (field task_id) when it does not
    exist."""
    get_task(conn, task_id)
    update_task_fields(conn, task_id, fields, now)


def remove_task(conn: Connection, task_id: str, now: float) -> list[Change]:
    """Delete the task: its queued and claimed runs are cancelled first (`task_deleted`: what the host is
    told), then its rows cascade. Raises NotFoundError (field task_id) when it does not exist."""
    get_task(conn, task_id)
    cancelled = run_claims.cancel_task_runs(conn, task_id, now)
    delete_task(conn, task_id)
    return cancelled


def delete_task(conn: Connection, task_id: str) -> bool:
    """Delete the task; its participants, decisions, runs and step entries go with it (ON DELETE CASCADE)."""
    return conn.execute("DELETE FROM tasks WHERE id = ?", (task_id,)).rowcount == 1


def task_info(task: TaskRecord) -> TaskInfo:
    """The task as replies show it (a dict display: calling a typed dict class costs a dict(**kwargs))."""
    return {
        "task_id": task.id,
        "workflow_id": task.workflow_id,
        "step_id": task.step_id,
        "title": task.title,
        "session_id": task.session_id,
        "primary_agent_id": task.primary_agent_id,
        "ceo_agent_id": task.ceo_agent_id,
        "priority": task.priority,
        "wip_admitted": task.wip_admitted,
        "queued_for_step_id": task.queued_for_step_id,
        "workflow_version": task.workflow_version,
    }


def places(conn: Connection, task_ids: Iterable[str]) -> dict[str, tuple[str, str]]:
    """(workflow_id, step_id) of each of `task_ids` that is a task of this runtime."""
    found: dict[str, tuple[str, str]] = {}
    for task_id in task_ids:
        task = find_task(conn, task_id)
        if task is not None:
            found[task_id] = (task.workflow_id, task.step_id)
    return found
