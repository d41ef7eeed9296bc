"""Moving a task from the version of its workflow it is pinned to onto another (`migrate_tasks`). Writer
thread: every function runs inside the caller's transaction; `migrate_task` is one task's whole migration,
so a crash leaves each task wholly on one version.

A task's migration, planned by `plan_task` and applied by `migrate_task` (the same reads, so a dry run says
what the migration does):
- its step (and the step it is queued for) become their mapped steps of the target version, and its row
  is pinned to that version (a compare-and-set on the version and step it was planned from);
- its queued and claimed runs at its step are kept (moved to the new step) when their agent is one the new
  step's on_enter queues for (`primary`, `workspace.ceo_agent`, `agent_profile_id:`, and the agents seated
  in a role a fan-out or `participant_role:` names), else cancelled with reason `migrated` through the
  runs' own cancel path (`run_claims.cancel`); with `enter`, all are cancelled (the new entry queues anew);
- its own seats at the step move to the new step, and the template-level seats of the step are copied to
  it as its own at the new step; the decisions of the step's round move with them;
- its open step entry is closed as `migrated` (no second fan-out); with `enter`, a new entry of the new step
  is allocated (path E4) for the Trio side to dispatch;
- a `migrated` item goes into its history (store/tasks/history.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from onceflow.protocol.errors import ConflictError, NotFoundError
from onceflow.protocol.workflow import QueueRunConfig, QueueRunForEachParticipantConfig, Step
from onceflow.store.backends.connection import Connection
from onceflow.store.entries import step_entries
from onceflow.store.entries.segment import close_entry
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.records import TaskRecord
from onceflow.store.runs import run_claims
from onceflow.store.runs.runs import Change
from onceflow.store.tasks import history, tasks

MAX_TASKS = 10_000
"""At most this many tasks in one `migrate_tasks` (a larger set is refused: migrate it by `task_ids`)."""


@attrs.frozen
class TaskPlan:
    """What migrating one task does (module docstring); `entry`: none, closed or entered."""

    task_id: str
    from_version: int
    from_step: str
    to_step: str
    queued_for: str | None
    runs_kept: tuple[int, ...]
    runs_cancelled: tuple[int, ...]
    seats_moved: int
    entry: str
    open_entry: EntryKey | None


@attrs.frozen
class Migrated:
    """What `migrate_task` committed: its plan (None: the task was already on the target version, or had
    moved since it was planned: nothing done), the run changes to publish, and the new entry to dispatch."""

    plan: TaskPlan | None
    changes: tuple[Change, ...] = ()
    entered: EntryKey | None = None
    task: TaskRecord | None = None


def tasks_to_migrate(
    conn: Connection, workflow_id: str, to_version: int, task_ids: Sequence[str] | None
) -> tuple[list[TaskRecord], list[str]]:
    """(the tasks of `workflow_id` not on `to_version`, in id order; the named ones already on it). Given
    `task_ids`, only those. Raises NotFoundError (field task_ids) for a named task that does not exist or is
    of another workflow, ConflictError (field task_ids) past `MAX_TASKS`."""
    if task_ids is None:
        rows = conn.execute(
            f"SELECT {tasks.TASK_COLUMNS} FROM tasks WHERE workflow_id = ? AND workflow_version <> ?"
            " ORDER BY id LIMIT ?",
            (workflow_id, to_version, MAX_TASKS + 1),
        ).fetchall()
        found = [tasks.task_from_row(row) for row in rows]
        if len(found) > MAX_TASKS:
            raise ConflictError(
                f"more than {MAX_TASKS} tasks to migrate: name them in task_ids, in parts", field="task_ids"
            )
        return found, []
    todo: list[TaskRecord] = []
    already: list[str] = []
    for task_id in sorted(set(task_ids)):
        task = tasks.find_task(conn, task_id)
        if task is None or task.workflow_id != workflow_id:
            raise NotFoundError(
                f"task {task_id!r} is not a task of workflow {workflow_id!r}", field="task_ids"
            )
        if task.workflow_version == to_version:
            already.append(task_id)
        else:
            todo.append(task)
    return todo, already


def map_step(step_id: str, step_map: Mapping[str, str], target_steps: Sequence[str]) -> str | None:
    """The step of the target version `step_id` maps to: its mapping, else itself when the target has it,
    else None (unmapped)."""
    if step_id in step_map:
        return step_map[step_id]
    return step_id if step_id in target_steps else None


Seat = tuple[int, str, str, bool, int, bool]
"""A seat: (participant id, role, agent, decision_required, position, template-level?)."""


def _seated(conn: Connection, task: TaskRecord, step_id: str) -> list[Seat]:
    """The task's seats at `step_id` (its own and the template-level ones)."""
    rows = conn.execute(
        "SELECT id, role, agent_profile_id, decision_required, position, task_id IS NULL FROM participants"
        " WHERE workflow_id = ? AND step_id = ? AND (task_id = ? OR task_id IS NULL) ORDER BY id",
        (task.workflow_id, step_id, task.id),
    ).fetchall()
    return [(int(r[0]), r[1], r[2], bool(r[3]), int(r[4]), bool(r[5])) for r in rows]


def _agents_for(task: TaskRecord, step: Step, seats: Sequence[Seat]) -> set[str]:
    """The agents the on_enter of `step` queues runs for, given the seats that move there."""
    agents: set[str] = set()
    for action in step.events.on_enter:
        config = action.config
        if isinstance(config, QueueRunForEachParticipantConfig):
            agents.update(seat[2] for seat in seats if seat[1] == config.role)
        elif isinstance(config, QueueRunConfig):
            target = config.target
            if target == "primary" and task.primary_agent_id:
                agents.add(task.primary_agent_id)
            elif target == "workspace.ceo_agent" and task.ceo_agent_id:
                agents.add(task.ceo_agent_id)
            elif target.startswith("agent_profile_id:"):
                agents.add(target.split(":", 1)[1])
            elif target.startswith("participant_role:"):
                role = target.split(":", 1)[1]
                agents.update(seat[2] for seat in seats if seat[1] == role)
    agents.discard("")
    return agents


def plan_task(
    conn: Connection,
    task: TaskRecord,
    to_step: Step,
    queued_for: str | None,
    step_map: Mapping[str, str],
    to_ids: Sequence[str],
    *,
    enter: bool,
) -> TaskPlan:
    """What migrating `task` to `to_step` (its queued-for step mapped to `queued_for`; its seats at other
    steps by `step_map` onto the steps `to_ids`) does: reads only."""
    seats = _seated(conn, task, task.step_id)
    agents = set() if enter else _agents_for(task, to_step, seats)
    runs = conn.execute(
        "SELECT id, agent_profile_id, workflow_step_id FROM runs WHERE task_id = ?"
        " AND status IN ('queued', 'claimed') ORDER BY id",
        (task.id,),
    ).fetchall()
    kept = tuple(int(r[0]) for r in runs if r[1] in agents and r[2] in (task.step_id, None))
    cancelled = tuple(int(r[0]) for r in runs if int(r[0]) not in kept)
    moved = _own_seats_moving(conn, task, step_map, to_ids)
    if to_step.id != task.step_id:
        moved += sum(1 for seat in seats if seat[5])  # the step's template rows, copied to the task
    (latest,) = conn.execute(
        "SELECT MAX(entry_seq) FROM step_entries WHERE task_id = ? AND step_id = ? AND terminal = 0",
        (task.id, task.step_id),
    ).fetchone()
    open_entry = None if latest is None else EntryKey(task.id, task.step_id, int(latest))
    entry = "entered" if enter and task.wip_admitted else "closed" if open_entry is not None else "none"
    return TaskPlan(
        task.id,
        task.workflow_version,
        task.step_id,
        to_step.id,
        queued_for,
        kept,
        cancelled,
        moved,
        entry,
        open_entry,
    )


def migrate_task(
    conn: Connection,
    task_id: str,
    from_version: int,
    to_version: int,
    steps: tuple[Mapping[str, Step], Mapping[str, Step]],
    step_map: Mapping[str, str],
    enter: bool,
    now: float,
) -> Migrated:
    """Migrate one task (module docstring) from `from_version` onto `to_version`; `steps` are the steps by
    id of both versions (from, to; the former's only to close an open entry by its declaration). Nothing
    is done (plan None) when the task is gone, already on `to_version`, or on another version than
    `from_version`. Raises NotFoundError (field step_map) when its step no longer maps."""
    task = tasks.find_task(conn, task_id)
    if task is None or task.workflow_version != from_version:
        return Migrated(None)
    from_steps, to_steps = steps
    ids = list(to_steps)
    to_id = map_step(task.step_id, step_map, ids)
    queued_for = None if task.queued_for_step_id is None else map_step(task.queued_for_step_id, step_map, ids)
    if to_id is None or (task.queued_for_step_id is not None and queued_for is None):
        raise NotFoundError(f"task {task.id!r}: step {task.step_id!r} maps to no step", field="step_map")
    plan = plan_task(conn, task, to_steps[to_id], queued_for, step_map, ids, enter=enter)
    changes: list[Change] = []
    for run_id in plan.runs_cancelled:
        done, change = run_claims.cancel(conn, run_id, "migrated", now)
        if done and change is not None:
            changes.append(change)
    if plan.runs_kept and to_id != task.step_id:
        conn.execute(
            f"UPDATE runs SET workflow_step_id = ? WHERE id IN ({', '.join('?' * len(plan.runs_kept))})",
            (to_id, *plan.runs_kept),
        )
    for old_step, new_step in _own_moves(conn, task, step_map, ids).items():
        conn.execute(
            "UPDATE participants SET step_id = ? WHERE task_id = ? AND workflow_id = ? AND step_id = ?",
            (new_step, task.id, task.workflow_id, old_step),
        )
        conn.execute(
            "UPDATE decisions SET step_id = ? WHERE task_id = ? AND step_id = ?",
            (new_step, task.id, old_step),
        )
    if to_id != task.step_id:
        _copy_template_seats(conn, task, to_id)
    if plan.open_entry is not None:
        old = from_steps.get(task.step_id)
        close_entry(conn, plan.open_entry, old.events.on_enter if old else (), "migrated", now)
    admitted = enter and task.wip_admitted
    conn.execute(
        "UPDATE tasks SET workflow_version = ?, workflow_step_id = ?, queued_for_step_id = ?, updated_at = ?,"
        " admissions = admissions + ? WHERE id = ? AND workflow_version = ?",
        (to_version, to_id, queued_for, now, int(admitted), task.id, from_version),
    )
    entered = None
    if admitted:
        entered = step_entries.allocate_for(
            conn, task_id=task.id, workflow_id=task.workflow_id, step=to_steps[to_id], path="E4", now=now
        )
    detail = {
        "workflow_id": task.workflow_id,
        "from_version": from_version,
        "to_version": to_version,
        "from_step": task.step_id,
        "to_step": to_id,
        "runs_kept": list(plan.runs_kept),
        "runs_cancelled": list(plan.runs_cancelled),
        "seats_moved": plan.seats_moved,
        "entry": plan.entry,
    }
    history.record(conn, task.id, now, "migrated", detail)
    return Migrated(plan, tuple(changes), entered, tasks.get_task(conn, task.id))


def _own_moves(
    conn: Connection, task: TaskRecord, step_map: Mapping[str, str], to_ids: Sequence[str]
) -> dict[str, str]:
    """old step -> new step of every step the task has its own seats or decisions at that maps to another
    step (a step neither mapped nor in the target keeps them: nothing is dropped)."""
    rows = conn.execute(
        "SELECT step_id FROM participants WHERE task_id = ?"
        " UNION SELECT step_id FROM decisions WHERE task_id = ?",
        (task.id, task.id),
    ).fetchall()
    moves = {}
    for (old,) in rows:
        new = map_step(old, step_map, to_ids)
        if new is not None and new != old:
            moves[old] = new
    return moves


def _own_seats_moving(
    conn: Connection, task: TaskRecord, step_map: Mapping[str, str], to_ids: Sequence[str]
) -> int:
    """How many of the task's own seats `_own_moves` moves."""
    moving = _own_moves(conn, task, step_map, to_ids)
    rows = conn.execute("SELECT step_id FROM participants WHERE task_id = ?", (task.id,)).fetchall()
    return sum(1 for (step_id,) in rows if step_id in moving)


def _copy_template_seats(conn: Connection, task: TaskRecord, to_id: str) -> None:
    """The template-level seats of the task's step, copied to it as its own at `to_id` (template rows are
    the workflow's, shared by every version and task; one already at `to_id` is not copied)."""
    conn.execute(
        "INSERT INTO participants (workflow_id, step_id, task_id, role, agent_profile_id, decision_required,"
        " position) SELECT workflow_id, ?, ?, role, agent_profile_id, decision_required, position"
        " FROM participants AS p WHERE task_id IS NULL AND workflow_id = ? AND step_id = ?"
        " AND NOT EXISTS (SELECT 1 FROM participants AS q WHERE q.task_id IS NULL AND q.workflow_id ="
        " p.workflow_id AND q.step_id = ? AND q.role = p.role AND q.agent_profile_id = p.agent_profile_id)"
        " ORDER BY id",
        (to_id, task.id, task.workflow_id, task.step_id, to_id),
    )


def plan_all(
    conn: Connection,
    todo: Sequence[TaskRecord],
    to_steps: Mapping[str, Step],
    step_map: Mapping[str, str],
    enter: bool,
) -> list[TaskPlan]:
    """`plan_task` of each task of `todo` (a dry run: reads only); each task's step must map."""
    plans = []
    ids = list(to_steps)
    for task in todo:
        to_id = map_step(task.step_id, step_map, ids)
        queued = None if task.queued_for_step_id is None else map_step(task.queued_for_step_id, step_map, ids)
        if to_id is None:
            raise NotFoundError(f"task {task.id!r}: step {task.step_id!r} maps to no step", field="step_map")
        plans.append(plan_task(conn, task, to_steps[to_id], queued, step_map, ids, enter=enter))
    return plans
