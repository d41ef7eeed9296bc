"""Bulk rows for measurements: a board's history written straight into the tables, many rows per statement.
Any thread that owns the connection it is given (bench/views.py calls it on its main thread, on a database
no runtime has open).

`fill_history` writes what a long-running board leaves behind, finished work only: tasks resting at their
workflow's last step, each with terminal step entries (one `done` marker each), finished runs and approved
decisions, the way the runtime writes them (the same tables, columns and keys), so the read-only views and
the protocol's queries read them as they would read a real board's. It is `executemany` in the caller's
transaction (no BEGIN or COMMIT here): 300,000 entries take seconds, not the hours the runtime would take.
Memory stays bounded: rows are generated per task, never collected first.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from onceflow.store.backends.connection import Connection
from onceflow.store.runs import digests


@attrs.frozen
class Filled:
    """What `fill_history` wrote: row counts per table."""

    tasks: int
    entries: int
    runs: int
    decisions: int


def fill_history(
    conn: Connection,
    *,
    workflow_id: str,
    step_ids: Sequence[str],
    tasks: int,
    entries_per_task: int,
    runs_per_entry: int,
    now: float,
    prefix: str = "bulk-",
) -> Filled:
    """Insert `tasks` tasks of the registered workflow `workflow_id` (ids `<prefix><n>`, zero-padded so id
    order is creation order), each at the last of `step_ids` after `entries_per_task` terminal entries
    cycling through `step_ids`; per entry one `done` marker, `runs_per_entry` finished runs (agent
    `agent-<k>`) and one approved decision. Times are `now` (Unix seconds) plus a microsecond per row.

    Raises:
        ValueError: `step_ids` is empty or a count is negative. sqlite3.IntegrityError: a task id is taken.
    """
    if not step_ids or min(tasks, entries_per_task, runs_per_entry) < 0:
        raise ValueError("step_ids must name a step and every count must be at least 0")
    width = len(str(max(tasks - 1, 0)))
    ids = [f"{prefix}{n:0{width}d}" for n in range(tasks)]
    last = step_ids[-1]
    conn.executemany(
        "INSERT INTO tasks (id, workflow_id, workflow_step_id, title, priority, wip_admitted, created_at,"
        " updated_at, admissions) VALUES (?, ?, ?, ?, 'medium', 1, ?, ?, ?)",
        ((task, workflow_id, last, f"task {task}", now, now, entries_per_task) for task in ids),
    )
    digests.keep(conn, [""])  # an entry holds its declaration digest's id (store/runs/digests.py)
    conn.executemany(
        "INSERT INTO step_entries (task_id, step_id, entry_seq, workflow_id, declaration_digest, entry_path,"
        f" terminal, created_at) VALUES (?, ?, ?, ?, {digests.id_sql('?')}, 'E1', 1, ?)",
        ((task, *_place(step_ids, n), workflow_id, "", now) for task, n in _entries(ids, entries_per_task)),
    )
    conn.executemany(
        "INSERT INTO step_entry_markers (task_id, step_id, entry_seq, position, kind, state, epoch, detail,"
        " updated_at) VALUES (?, ?, ?, 0, 'queue_run', 'done', NULL, '', ?)",
        ((task, *_place(step_ids, n), now) for task, n in _entries(ids, entries_per_task)),
    )
    conn.executemany(
        "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, status, requested_at,"
        " finished_at, trigger, entry_seq, admission_seq, attempt, outcome_reason)"
        " VALUES (?, ?, ?, 'step_entered', 'finished', ?, ?, 'on_enter', ?, ?, 1, 'finished')",
        _runs(ids, step_ids, entries_per_task, runs_per_entry, now),
    )
    conn.executemany(
        "INSERT INTO decisions (task_id, step_id, role, decider_type, decider_id, decision, created_at)"
        " VALUES (?, ?, 'reviewer', 'agent', 'agent-0', 'approved', ?)",
        ((task, _place(step_ids, n)[0], now) for task, n in _entries(ids, entries_per_task)),
    )
    total = tasks * entries_per_task
    return Filled(tasks=tasks, entries=total, runs=total * runs_per_entry, decisions=total)


def _entries(ids: list[str], per_task: int) -> Iterator[tuple[str, int]]:
    return ((task, n) for task in ids for n in range(per_task))


def _place(step_ids: Sequence[str], n: int) -> tuple[str, int]:
    """The entry `n` of a task (0-based): its step, cycling through `step_ids`, and its entry_seq there."""
    return step_ids[n % len(step_ids)], n // len(step_ids) + 1


def _runs(
    ids: list[str], step_ids: Sequence[str], per_task: int, per_entry: int, now: float
) -> Iterator[tuple[Any, ...]]:
    row = 0
    for task in ids:
        for n in range(per_task):
            step, seq = _place(step_ids, n)
            for k in range(per_entry):
                row += 1
                at = now + row * 1e-6
                yield (f"agent-{k}", task, step, at, at, seq, n + 1)
