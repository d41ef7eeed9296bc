"""The recovery scan's common case, set-oriented: many untouched open entries finished by a few statements.

An open entry is "common" when its task still stands at the entry's step in the entry's workflow, the entry
is the latest of its (task, step), its recorded declaration digest is the current one, it has no marker
yet, the task has no per-task participant rows, every engine-owned action of the declaration is
`clear_decisions` or `queue_run_for_each_participant` served by the built-in executor, every participant the
fan-out matches has an agent, and no idempotency key the fan-out would write is taken. Those entries of one
(workflow, step) are finished together in one savepoint: one DELETE for the clears, one multi-row runs
insert (`ON CONFLICT DO NOTHING RETURNING`), one multi-row marker insert, one terminal UPDATE. Any anomaly
(a returned row missing, a database error that does not end the transaction) rolls the savepoint back and
leaves every entry of the group to the per-entry path, which decides it exactly as before; an error that
ends the transaction is re-raised (issue 11 item 4). The effects and events are those the executors build.
Source: issue 14 item "Recovery: set-oriented SQL for the common case"; on-enter-action-dispatch.md AC-B9.
"""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from collections.abc import Sequence

import attrs

from onceflow import metrics
from onceflow.actors.actions import dedupe_seats
from onceflow.actors.common_entry import (
    Anomaly,
    Done,
    common_order,
    common_result,
    fan_out_notes,
    reason,
    run_key,
)
from onceflow.actors.on_enter import OnEnterDispatch, SegmentResult, dispatch_order
from onceflow.actors.outbox import Outbox
from onceflow.actors.services import Services
from onceflow.logs import get_logger
from onceflow.protocol.workflow import ActionDecl, Step, Workflow
from onceflow.store import faults, tasks
from onceflow.store.participants import template_participants
from onceflow.store.records import StepEntry, TaskRecord
from onceflow.store.runs import payload_json
from onceflow.store.savepoint import savepoint
from onceflow.store.step_entries import EntryKey, declaration_digest

log = get_logger("onceflow.recovery")

_TASK_COLUMNS = ", ".join(f"t.{c.strip()}" for c in tasks.TASK_COLUMNS.split(","))


@attrs.frozen
class SetEntry:
    """One entry the set path finished: per position, the decisions its clear deleted (an int) or the runs
    its fan-out queued ((agent_profile_id, run_id, idempotency_key) in participant order)."""

    dispatch: OnEnterDispatch
    done: Done

    def result(self) -> SegmentResult:
        """The `SegmentResult` the per-entry path builds for this entry: the executors' effects and events."""
        dispatch = self.dispatch
        order = dispatch_order(dispatch.step.events.on_enter, "recovery")
        return common_result(dispatch.task.id, dispatch.step, order, self.done)

    def publish(self, out: Outbox) -> None:
        """Publish what the entry did. When the hub has a subscriber: exactly the per-entry path's events and
        diagnostics (`result`). When nobody can receive an event (the scan runs before `open_runtime` yields,
        so at startup nobody can): the same diagnostics logged and the same runs counted, no event built."""
        if out.has_audience():
            self.dispatch.publish_segment(self.result())
            return
        actions = dict(dispatch_order(self.dispatch.step.events.on_enter, "recovery"))
        for position, done in self.done:
            if isinstance(done, int):
                continue
            task_id, step = self.dispatch.task.id, self.dispatch.step
            for note in fan_out_notes(task_id, step, actions[position], len(done)):
                out.log(note.level, note.code, **note.fields)
            metrics.RUNS.add(len(done), {"result": "queued"})


@attrs.frozen
class Group:
    """The set plan of one (workflow, step): its recovery order and, per fan-out position, the agents it
    queues for (template participants, deduplicated, in order)."""

    workflow: Workflow
    step: Step
    order: tuple[tuple[int, ActionDecl], ...]
    agents: dict[int, tuple[str, ...]]


@attrs.frozen
class Member:
    """An entry of a batch the set path may finish: its place in the batch, its key and task row."""

    index: int
    key: EntryKey
    task: TaskRecord
    group: Group


def plan_common(
    conn: sqlite3.Connection, services: Services, batch: Sequence[tuple[StepEntry, int]]
) -> dict[int, Member]:
    """Which entries of `batch` the set path may finish, by index (writer thread; reads only).

    An entry qualifies when it is the latest of its (task, step), its digest is current, `common_order`
    accepts its step, its task is at that step in that workflow with no per-task participant, it has no
    marker, every participant its fan-outs match has an agent, and none of its keys was merged into a run by
    coalescing.
    """
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for index, (entry, latest) in enumerate(batch):
        if latest == entry.entry_seq:
            groups[(entry.workflow_id, entry.step_id)].append(index)
    members: dict[int, Member] = {}
    for (workflow_id, step_id), indexes in groups.items():
        group = _group(conn, services, workflow_id, step_id)
        if group is None:
            continue
        digest = declaration_digest([a.type for a in group.step.events.on_enter])
        candidates = [i for i in indexes if batch[i][0].declaration_digest == digest]
        if not candidates:
            continue
        rows = conn.execute(
            f"SELECT CAST(j.value ->> 2 AS INTEGER), {_TASK_COLUMNS} FROM json_each(?1) AS j"
            " CROSS JOIN tasks AS t ON t.id = j.value ->> 0"
            " WHERE t.workflow_id = ?2 AND t.workflow_step_id = ?3"
            " AND NOT EXISTS (SELECT 1 FROM step_entry_markers AS m WHERE m.task_id = t.id AND m.step_id = ?3"
            " AND m.entry_seq = CAST(j.value ->> 1 AS INTEGER))"
            " AND NOT EXISTS (SELECT 1 FROM participants AS p WHERE p.task_id = t.id)",
            (
                json.dumps([[batch[i][0].task_id, batch[i][0].entry_seq, i] for i in candidates]),
                workflow_id,
                step_id,
            ),
        ).fetchall()
        found = [
            Member(
                row[0],
                EntryKey(row[1], step_id, batch[row[0]][0].entry_seq),
                tasks.task_from_row(row[1:]),
                group,
            )
            for row in rows
        ]
        keys = [key for member in found for _, _, key in _requests(member)]
        merged = (
            {
                key
                for (key,) in conn.execute(
                    "SELECT k.idempotency_key FROM json_each(?) AS j CROSS JOIN coalesced_keys AS k"
                    " ON k.idempotency_key = j.value",
                    (json.dumps(keys),),
                ).fetchall()
            }
            if keys
            else set()
        )
        for member in found:
            if not merged or merged.isdisjoint(key for _, _, key in _requests(member)):
                members[member.index] = member
    return members


def _group(conn: sqlite3.Connection, services: Services, workflow_id: str, step_id: str) -> Group | None:
    workflow = services.workflows.workflows.get(workflow_id)
    if workflow is None or not workflow.has_step(step_id):
        return None
    step = workflow.step(step_id)
    order = common_order(services, step, "recovery")
    if order is None:
        return None
    template = template_participants(conn, workflow_id=workflow_id, step_id=step_id)
    agents: dict[int, tuple[str, ...]] = {}
    for position, action in order:
        if action.type == "queue_run_for_each_participant":
            role: str = action.config.role  # type: ignore[union-attr]
            matching = dedupe_seats(p for p in template if p.role == role)
            if any(not p.agent_profile_id for p in matching):
                return None  # a participant failure: the per-entry path reports it
            agents[position] = tuple(p.agent_profile_id for p in matching)
    return Group(workflow, step, tuple(order), agents)


def _requests(member: Member) -> list[tuple[int, str, str]]:
    """(position, agent, idempotency key) of every run the member's fan-outs queue, in dispatch order; the
    key is the one `OnEnterDispatch.context` builds."""
    key = member.key
    actions = dict(member.group.order)
    return [
        (position, agent, run_key(key, position, agent, actions[position]))
        for position, agents in member.group.agents.items()
        for agent in agents
    ]


def finish_common(
    conn: sqlite3.Connection, services: Services, members: Sequence[Member], now: float, out: Outbox
) -> list[SetEntry] | None:
    """Finish `members` (consecutive in the batch, one group) in one savepoint; None when an anomaly rolled
    it back, leaving them to the per-entry path.

    Raises:
        sqlite3.Error: an error that ended the transaction (`faults.ends_transaction`).
    """
    try:
        with savepoint(conn, "recover_set"):
            done = _finish(conn, members, now)
    except Exception as exc:
        if faults.ends_transaction(conn, exc):
            raise
        group = members[0].group
        log.info(
            "recovery_set_path_declined",
            workflow_id=group.workflow.id,
            step_id=group.step.id,
            cause=repr(exc),
        )
        return None
    group = members[0].group
    return [
        SetEntry(OnEnterDispatch(services, m.task, group.workflow, group.step, m.key, "recovery", out), did)
        for m, did in zip(members, done, strict=True)
    ]


def _finish(conn: sqlite3.Connection, members: Sequence[Member], now: float) -> list[Done]:
    """The group's actions for every member, set-oriented; what each position did, per member."""
    group = members[0].group
    step_id = group.step.id
    counts: dict[str, int] = {}
    if any(action.type == "clear_decisions" for _, action in group.order):
        counts = _clear(conn, step_id, [m.task.id for m in members])
    reasons = {p: reason(a) for p, a in group.order}
    payloads = {p: payload_json(getattr(a.config, "payload", None)) for p, a in group.order}
    requested = {m.index: _requests(m) for m in members}
    ids = _insert_runs(
        conn,
        step_id,
        [
            (m.task.id, reasons[p], payloads[p], agent, key)
            for m in members
            for p, agent, key in requested[m.index]
        ],
        now,
    )
    done: list[Done] = []
    for m in members:
        did: list[tuple[int, int | tuple[tuple[str, int, str], ...]]] = []
        for position, action in group.order:
            if action.type == "clear_decisions":
                did.append((position, counts.get(m.task.id, 0)))
            else:
                runs = tuple((a, ids[k], k) for p, a, k in requested[m.index] if p == position)
                did.append((position, runs))
        done.append(tuple(did))
    entries = json.dumps([[m.task.id, m.key.entry_seq] for m in members])
    conn.execute(
        "INSERT INTO step_entry_markers (task_id, step_id, entry_seq, position, kind, state, epoch, detail,"
        " updated_at) SELECT e.value ->> 0, ?1, CAST(e.value ->> 1 AS INTEGER),"
        " CAST(p.value ->> 0 AS INTEGER), p.value ->> 1, 'done', NULL,"
        " '', ?2 FROM json_each(?3) AS e, json_each(?4) AS p",
        (step_id, now, entries, json.dumps([[p, a.type] for p, a in group.order])),
    )
    terminal = conn.execute(
        "UPDATE step_entries SET terminal = 1 WHERE step_id = ?1 AND terminal = 0"
        " AND (task_id, entry_seq) IN (SELECT value ->> 0, CAST(value ->> 1 AS INTEGER) FROM json_each(?2))",
        (step_id, entries),
    ).rowcount
    if terminal != len(members):
        raise Anomaly(f"{terminal} entries flagged terminal of {len(members)}")
    return done


def _clear(conn: sqlite3.Connection, step_id: str, task_ids: list[str]) -> dict[str, int]:
    """Delete the step's decisions of every task in one statement; the count deleted per task."""
    listed = json.dumps(task_ids)
    counts = dict(
        conn.execute(
            "SELECT task_id, COUNT(*) FROM decisions WHERE step_id = ?"
            " AND task_id IN (SELECT value FROM json_each(?)) GROUP BY task_id",
            (step_id, listed),
        ).fetchall()
    )
    deleted = conn.execute(
        "DELETE FROM decisions WHERE step_id = ? AND task_id IN (SELECT value FROM json_each(?))",
        (step_id, listed),
    ).rowcount
    if deleted != sum(counts.values()):
        raise Anomaly(f"deleted {deleted} decisions, counted {sum(counts.values())}")
    return counts


def _insert_runs(
    conn: sqlite3.Connection, step_id: str, requested: list[tuple[str, str, str | None, str, str]], now: float
) -> dict[str, int]:
    """One multi-row insert of queued runs, (task_id, reason, payload JSON, agent, key) in order; the run
    id per key.

    Raises:
        Anomaly: a key was already taken (its row was not inserted).
    """
    if not requested:
        return {}
    returned = conn.execute(
        "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, payload, idempotency_key,"
        " exclude_from_coalescing, requested_at) SELECT value ->> 0, value ->> 1, ?1, value ->> 2,"
        " value ->> 3, value ->> 4, 1, ?2 FROM json_each(?3) WHERE true ON CONFLICT (idempotency_key)"
        " DO NOTHING RETURNING idempotency_key, id",
        (
            step_id,
            now,
            json.dumps(
                [[agent, task_id, reason, payload, key] for task_id, reason, payload, agent, key in requested]
            ),
        ),
    ).fetchall()
    if len(returned) != len(requested):
        raise Anomaly(f"{len(requested) - len(returned)} idempotency keys already taken")
    return dict(returned)
