"""The common step entry: an on_enter of built-in clears and fan-outs only, written in one savepoint.

Most entries declare nothing but `clear_decisions` and `queue_run_for_each_participant` (served by the
built-in executors). For those the admitting request runs in one savepoint (the writer's per-request one,
`request_savepoint`): the step compare-and-set, the entry insert (already terminal: the savepoint either
finishes the entry or leaves no trace), the participant read, the clear, one multi-row marker insert and
one multi-row runs insert with `ON CONFLICT DO NOTHING RETURNING`. Any anomaly (the task moved, the step is
at its WIP limit, a seat without
an agent, an idempotency key already taken or merged by coalescing, any database error that does not end
the transaction) rolls back to that savepoint and the caller takes the per-action path, which decides it
exactly as before; an error that ends the transaction is re-raised (issue 11 item 4). The effects and
events are those the executors build (`common_result`).
Source: issue 14 item "A writer fast path for the common entry"; on-enter-action-dispatch.md AC-B5, AC-B6,
AC-B7, AC-C1, AC-A3, AC-A5.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence

import attrs

from onceflow.actors import trusted
from onceflow.actors.actions import (
    DEFAULT_EXECUTORS,
    DiagnosticNote,
    Effect,
    config_digest,
    dedupe_seats,
    step_participants,
)
from onceflow.actors.on_enter import ActionRun, SegmentResult, dispatch_order
from onceflow.actors.services import Services
from onceflow.logs import get_logger
from onceflow.protocol.events import EntryPath
from onceflow.protocol.workflow import ActionDecl, Step
from onceflow.store import faults, tasks, wip
from onceflow.store.records import TaskRecord
from onceflow.store.runs import payload_json
from onceflow.store.savepoint import request_savepoint
from onceflow.store.step_entries import EntryKey, declaration_digest

log = get_logger("onceflow.on_enter")

COMMON_KINDS = ("clear_decisions", "queue_run_for_each_participant")

Queued = tuple[tuple[str, int, str], ...]
"""The runs a fan-out queued: (agent_profile_id, run_id, idempotency_key) in participant order."""

Done = tuple[tuple[int, int | Queued], ...]
"""Per position in dispatch order: what its clear deleted (a count), or the runs its fan-out queued."""


class Anomaly(Exception):
    """The common path cannot decide this entry alone: the per-action path must."""


def common_order(
    services: Services, step: Step, path: EntryPath
) -> tuple[tuple[int, ActionDecl], ...] | None:
    """The dispatch order of `step` on `path` when every action in it is a built-in clear or fan-out with a
    role (nothing waits on the host), else None. On PostgreSQL too: store/postgres.py translates the
    statements' json_each and numbered parameters (issue 15)."""
    order = dispatch_order(step.events.on_enter, path)
    if not order:
        return None
    for _, action in order:
        if action.type not in COMMON_KINDS:
            return None
        if services.executors.get(action.type) is not DEFAULT_EXECUTORS[action.type]:
            return None
        if action.type == "queue_run_for_each_participant" and not getattr(action.config, "role", ""):
            return None
    return tuple(order)


def reason(action: ActionDecl) -> str:
    """The fan-out's reason: its config's, else the trigger (on_enter), as `ActionContext` names it."""
    return getattr(action.config, "reason", None) or "on_enter"


def digest(action: ActionDecl) -> str:
    """The config digest in a fan-out's idempotency keys (AC-H7), as the executor computes it."""
    role: str = getattr(action.config, "role", "")
    return config_digest(
        {"role": role, "reason": reason(action), "payload": getattr(action.config, "payload", None)}
    )


def run_key(key: EntryKey, position: int, agent: str, action: ActionDecl) -> str:
    """The on_enter idempotency key `OnEnterDispatch.context` builds for one run."""
    return f"on_enter:{key.task_id}:{key.step_id}:{key.entry_seq}:{position}:{agent}:{digest(action)}"


def fan_out_notes(task_id: str, step: Step, action: ActionDecl, queued: int) -> tuple[DiagnosticNote, ...]:
    """The diagnostics `queue_run_for_each_participant` returns when each of `queued` seats got its run."""
    role: str = getattr(action.config, "role", "")
    finished = DiagnosticNote(
        "info",
        "fan_out_finished",
        {
            "task_id": task_id,
            "step_id": step.id,
            "role": role,
            "matching": queued,
            "enqueued": queued,
            "suppressed": 0,
        },
    )
    if queued:
        return (finished,)
    nobody = DiagnosticNote(
        "warning",
        "fan_out_matched_nobody",
        {"task_id": task_id, "step_id": step.id, "step_name": step.name, "role": role},
    )
    return (nobody, finished)


def common_result(
    task_id: str, step: Step, order: Sequence[tuple[int, ActionDecl]], done: Done
) -> SegmentResult:
    """The `SegmentResult` the per-action path builds for an entry that did `done`: the executors' effects,
    events and diagnostics, in position order."""
    actions = dict(order)
    runs = []
    step_id = step.id
    # Every value below is the runtime's own and typed (ids it wrote, counts, keys): built without validation
    for position, did in done:
        action = actions[position]
        if isinstance(did, int):
            cleared = trusted.decisions_cleared(task_id=task_id, step_id=step_id, deleted=did)
            effect = Effect("done", events=(cleared,))
        else:
            why = reason(action)
            events = tuple(
                trusted.run_queued(
                    run_id=run_id,
                    task_id=task_id,
                    step_id=step_id,
                    agent_profile_id=agent,
                    reason=why,
                    idempotency_key=key,
                )
                for agent, run_id, key in did
            )
            effect = Effect("done", events=events, diagnostics=fan_out_notes(task_id, step, action, len(did)))
        runs.append(ActionRun(position, action, "claimed", effect))
    return SegmentResult(tuple(runs))


@attrs.frozen
class Admitted:
    """A common entry admitted and finished in one savepoint: its key and what each position did."""

    key: EntryKey
    done: Done


def admit_common(
    conn: sqlite3.Connection,
    *,
    task: TaskRecord,
    workflow_id: str,
    step: Step,
    order: Sequence[tuple[int, ActionDecl]],
    path: EntryPath,
    now: float,
    version: tuple[str, bool, int] | None = None,
) -> Admitted | None:
    """Admit `task` to `step` and run its whole on_enter in one savepoint (writer thread); None when an
    anomaly rolled it back and nothing of it remains. It must be the first write of its writer request: the
    savepoint is the request's own (`request_savepoint`, two statements fewer per entry). `version` (a
    cached row's workflow id, admitted flag and admission count) is verified by the compare-and-set too
    (`tasks.move_task_step`).

    Raises:
        sqlite3.Error: an error that ended the transaction (`faults.ends_transaction`).
    """
    try:
        with request_savepoint(conn):  # the first write of the admitting request (Engine.enter_step)
            return _admit(conn, task, workflow_id, step, order, path, now, version)
    except Exception as exc:
        if faults.ends_transaction(conn, exc):
            raise
        if not isinstance(exc, Anomaly):
            log.info("common_entry_declined", task_id=task.id, step_id=step.id, cause=repr(exc))
        return None


def _admit(
    conn: sqlite3.Connection,
    task: TaskRecord,
    workflow_id: str,
    step: Step,
    order: Sequence[tuple[int, ActionDecl]],
    path: EntryPath,
    now: float,
    version: tuple[str, bool, int] | None,
) -> Admitted:
    if step.wip_limit > 0 and not wip.has_room(conn, workflow_id, step.id, step.wip_limit, excluding=task.id):
        raise Anomaly("a queued placement")
    moved = tasks.move_task_step(
        conn,
        task_id=task.id,
        expected_step_id=task.step_id,
        workflow_id=workflow_id,
        step_id=step.id,
        now=now,
        version=version,
    )
    if not moved:
        raise Anomaly("the task moved")
    (seq,) = conn.execute(
        "INSERT INTO step_entries (task_id, step_id, entry_seq, workflow_id, declaration_digest, entry_path,"
        " terminal, created_at) SELECT ?1, ?2, COALESCE(MAX(entry_seq), 0) + 1, ?3, ?4, ?5, 1, ?6"
        " FROM step_entries WHERE task_id = ?1 AND step_id = ?2 RETURNING entry_seq",
        (
            task.id,
            step.id,
            workflow_id,
            declaration_digest([a.type for a in step.events.on_enter]),
            path,
            now,
        ),
    ).fetchone()
    key = EntryKey(task.id, step.id, seq)
    entered = attrs.evolve(task, workflow_id=workflow_id, step_id=step.id)
    prefix = f"on_enter:{key.task_id}:{key.step_id}:{key.entry_seq}:"
    requested: list[tuple[int, str, ActionDecl, str]] = []  # (position, agent, action, key) in order
    rows: list[list[str | None]] = []  # the runs insert's [agent, reason, payload, key], in the same order
    deleted: int | None = None
    for position, action in order:
        if action.type == "clear_decisions":
            if deleted is None:  # a second clear in the same entry finds nothing left
                deleted = conn.execute(
                    "DELETE FROM decisions WHERE task_id = ? AND step_id = ?", (task.id, step.id)
                ).rowcount
            continue
        seats = dedupe_seats(step_participants(conn, entered, step.id, getattr(action.config, "role", "")))
        if any(not seat.agent_profile_id for seat in seats):
            raise Anomaly("a seat without an agent")
        # per action, not per seat: what `run_key` and the executor compute for every run of it
        why, suffix = reason(action), digest(action)
        payload = payload_json(getattr(action.config, "payload", None))
        for seat in seats:
            agent = seat.agent_profile_id
            run = f"{prefix}{position}:{agent}:{suffix}"
            requested.append((position, agent, action, run))
            rows.append([agent, why, payload, run])
    conn.execute(
        "INSERT INTO step_entry_markers (task_id, step_id, entry_seq, position, kind, state, epoch, detail,"
        " updated_at) SELECT ?1, ?2, ?3, CAST(value ->> 0 AS INTEGER), value ->> 1, 'done', NULL, '', ?4"
        " FROM json_each(?5)",
        (task.id, step.id, seq, now, json.dumps([[p, a.type] for p, a in order])),
    )
    ids: dict[str, int] = {}
    if requested:
        returned = conn.execute(
            "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, payload, idempotency_key,"
            " exclude_from_coalescing, requested_at) SELECT value ->> 0, ?1, ?2, value ->> 1, value ->> 2,"
            " value ->> 3, 1, ?3 FROM json_each(?4) AS j WHERE NOT EXISTS (SELECT 1 FROM coalesced_keys AS k"
            " WHERE k.idempotency_key = j.value ->> 3) ON CONFLICT (idempotency_key) DO NOTHING"
            " RETURNING idempotency_key, id",
            (
                task.id,
                step.id,
                now,
                json.dumps(rows),
            ),
        ).fetchall()
        if len(returned) != len(requested):
            raise Anomaly("an idempotency key is already taken")
        ids = dict(returned)
    done: list[tuple[int, int | Queued]] = []
    cleared = False
    for position, action in order:
        if action.type == "clear_decisions":
            done.append((position, 0 if cleared else deleted or 0))
            cleared = True
        else:
            done.append((position, tuple((a, ids[k], k) for p, a, _, k in requested if p == position)))
    return Admitted(key, tuple(done))
