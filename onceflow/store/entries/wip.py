"""WIP limits on task rows: where a task lands (`place`), occupancy, and the promotion claims (entry path
E3). Writer thread: every function runs inside the caller's transaction.

A slot at a step is taken by a task there with `wip_admitted` set; queued tasks take none. A move or
transition into a full step lands the task queued there (not an entry: no record, no on_enter). Promotion,
run when a slot frees or a feeder gets work or at start-up, admits one task at a time into a step with
room, each claim in its own transaction with its step-entry record (`promote_one`):
1. a task queued in place at the step is admitted where it stands (shape (b): no step field changes);
2. else a task admitted at the step's feeder (`pull_from_step_id`) is pulled in;
3. else, for a full step this one feeds, a task queued there moves here to wait, admitted and still tagged
   for its target — the record names this step, the one it actually occupies.
Pulls do not cascade to the feeder's own feeder. Every claim re-counts inside its transaction and updates
only a row still in its expected state, so one task is never promoted twice. Sources: kandev-engine-notes.md
"WIP limits (entry path E3)"; on-enter-action-dispatch.md, write-site inventory sites 4-7.

Several runtimes on one PostgreSQL database: two transactions admitting different tasks into one step would
each count the other's admission as not yet committed and both see room. `has_room` therefore first takes
a transaction-scoped advisory lock keyed by (workflow, step) (`serialize_admissions`), held until the
admitting transaction commits, so the count it reads includes every admission committed before and none can
commit in between. SQLite needs none: its one writer already serializes every transaction.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from onceflow.protocol.errors import WipLimitError
from onceflow.protocol.workflow import Step, Workflow
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.dialect import Sql
from onceflow.store.backends.urls import on_postgres
from onceflow.store.entries import step_entries
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.tasks import history

# Candidate order: position, priority critical > high > medium > low, queued_at, created_at, id.
_ORDER = (
    " ORDER BY position, CASE priority WHEN 'critical' THEN 0 WHEN 'high' THEN 1 WHEN 'medium' THEN 2"
    " ELSE 3 END, queued_at, created_at, id LIMIT 1"
)


_OCCUPANCY = Sql.of(
    lambda d: (
        "SELECT COUNT(*) FROM tasks WHERE workflow_id = ? AND workflow_step_id = ? AND wip_admitted = 1"
        f" AND id {d.differs} ?"
    )
)


def occupancy(conn: Connection, workflow_id: str, step_id: str, *, excluding: str | None = None) -> int:
    """Admitted tasks at the step, not counting `excluding` (a task being moved does not block itself)."""
    (count,) = conn.execute(_OCCUPANCY.on(conn), (workflow_id, step_id, excluding)).fetchone()
    return int(count)


WIP_NAMESPACE = 0x7769  # 'wi': the first key of every step's admission lock (tasks use store.epochs' 0x6F66)


def serialize_admissions(conn: Connection, workflow_id: str, step_id: str) -> None:
    """On PostgreSQL, wait for the (workflow, step) admission lock, held until `conn`'s transaction ends;
    nothing on SQLite. Two steps whose keys hash alike share a lock, which only serializes more.

    Raises:
        faults.DatabaseFault: (busy) the wait exceeded the lock timeout, or PostgreSQL broke a deadlock
            with it (the store answers `storage_busy`, retryable).
    """
    if on_postgres(conn):
        conn.execute(
            "SELECT pg_advisory_xact_lock(?, hashtext(?))", (WIP_NAMESPACE, f"{workflow_id}\t{step_id}")
        )


def has_room(
    conn: Connection,
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


def _pinned(version: int | None) -> tuple[str, tuple[int, ...]]:
    """The condition (and its parameter) keeping the candidates pinned to `version` (None: any version)."""
    return ("", ()) if version is None else (" AND workflow_version = ?", (version,))


def queued_in_place(
    conn: Connection, workflow_id: str, step_id: str, version: int | None = None
) -> str | None:
    """The next task (pinned to `version`, when given) waiting at `step_id` for `step_id` itself, if any."""
    pinned, param = _pinned(version)
    row = conn.execute(
        "SELECT id FROM tasks WHERE workflow_id = ? AND workflow_step_id = ? AND wip_admitted = 0"
        " AND queued_for_step_id = ?" + pinned + _ORDER,
        (workflow_id, step_id, step_id, *param),
    ).fetchone()
    return row[0] if row else None


def feeder_candidate(
    conn: Connection, workflow_id: str, feeder_id: str, target_id: str, version: int | None = None
) -> str | None:
    """The next task (pinned to `version`, when given) admitted at the feeder that may be pulled into
    `target_id`."""
    pinned, param = _pinned(version)
    row = conn.execute(
        "SELECT id FROM tasks WHERE workflow_id = ? AND workflow_step_id = ? AND wip_admitted = 1"
        " AND (queued_for_step_id IS NULL OR queued_for_step_id = ?)" + pinned + _ORDER,
        (workflow_id, feeder_id, target_id, *param),
    ).fetchone()
    return row[0] if row else None


def occupied_steps(conn: Connection) -> set[tuple[str, str, bool]]:
    """Where tasks stand, one read: (workflow id, step id, admitted?) for every step holding any task."""
    rows = conn.execute("SELECT DISTINCT workflow_id, workflow_step_id, wip_admitted FROM tasks").fetchall()
    return {(workflow_id, step_id, bool(admitted)) for workflow_id, step_id, admitted in rows}


def admit(
    conn: Connection,
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
        " queued_at = CASE WHEN CAST(? AS TEXT) IS NULL THEN NULL ELSE queued_at END, updated_at = ?,"
        " admissions = admissions + 1"
        " WHERE id = ? AND workflow_step_id = ? AND wip_admitted = ?",
        (step_id, queued_for_step_id, queued_for_step_id, now, task_id, from_step_id, int(expected_admitted)),
    )
    return cur.rowcount == 1


@attrs.frozen
class Placement:
    """Where a task lands: at `step_id`, holding a slot there (`admitted`) or queued there for
    `queued_for` (the full step it waits for; None when admitted where it stands)."""

    step_id: str
    admitted: bool
    queued_for: str | None


def place(
    conn: Connection,
    workflow_id: str,
    target: Step,
    *,
    task_id: str | None = None,
    feeder: Step | None = None,
) -> Placement:
    """Where a task sent to `target` lands (the one WIP placement rule): at `target` holding a slot when it
    has room (`task_id`, a task being moved, does not count against itself); else queued at `target` for
    it — or, for a new task given `target`'s `feeder` step, admitted at the feeder when it has room, tagged
    for `target` (kandev-engine-notes.md, WIP limits).

    Raises:
        WipLimitError: given a `feeder`, `target` and the feeder are both full (field step_id).
    """
    if has_room(conn, workflow_id, target.id, target.wip_limit, excluding=task_id):
        return Placement(target.id, True, None)
    if feeder is None:
        return Placement(target.id, False, target.id)
    if has_room(conn, workflow_id, feeder.id, feeder.wip_limit):
        return Placement(feeder.id, True, target.id)
    raise WipLimitError(
        f"step {target.id!r} is at its WIP limit {target.wip_limit}"
        f" ({occupancy(conn, workflow_id, target.id)} admitted) and so is its feeder {feeder.id!r}",
        field="step_id",
    )


@attrs.frozen
class Promotion:
    """A task admitted by a promotion; `key` is None when the landing step allocates no record."""

    task_id: str
    workflow_id: str
    step_id: str
    key: EntryKey | None


def promote_one(
    conn: Connection, workflow: Workflow, step: Step, now: float, version: int | None = None
) -> Promotion | None:
    """Admit the next candidate into `step` (rules 1-3 of the module doc), with its step-entry record; None
    when the step is full or nobody is waiting for it. Given `version`, only tasks pinned to that version of
    the workflow (the one `workflow` is) are candidates; the slots are the step's, whatever the version."""
    if not has_room(conn, workflow.id, step.id, step.wip_limit):
        return None
    for task_id, from_step, admitted, tag in _claims(conn, workflow, step, version):
        if task_id and admit(
            conn,
            task_id=task_id,
            from_step_id=from_step,
            expected_admitted=admitted,
            step_id=step.id,
            queued_for_step_id=tag,
            now=now,
        ):
            key = step_entries.allocate_for(
                conn, task_id=task_id, workflow_id=workflow.id, step=step, path="E3", now=now
            )
            detail = history.transition_detail(
                from_step=from_step,
                to_step=step.id,
                workflow_id=workflow.id,
                trigger="wip_promotion",
                operation_id="",
                path="E3",
                entry_seq=key.entry_seq if key else None,
            )
            history.record_transition(conn, task_id, now, detail)
            return Promotion(task_id, workflow.id, step.id, key)
    return None


def _claims(
    conn: Connection, workflow: Workflow, step: Step, version: int | None
) -> Iterator[tuple[str, str, bool, str | None]]:
    """Candidates in rule order, as (task, from step, admitted there?, queued_for tag); queried lazily."""
    yield queued_in_place(conn, workflow.id, step.id, version) or "", step.id, False, None
    if step.pull_from_step_id:
        feeder = step.pull_from_step_id
        yield feeder_candidate(conn, workflow.id, feeder, step.id, version) or "", feeder, True, None
    for target in workflow.fed_by(step.id):
        if not has_room(conn, workflow.id, target.id, target.wip_limit, serialize=False):  # admits none
            yield queued_in_place(conn, workflow.id, target.id, version) or "", target.id, False, target.id
