"""The recovery scan's common case, set-oriented: many untouched open entries finished by a few statements.

An open entry is "common" when its task still stands at the entry's step in the entry's workflow, the entry
is the latest of its (task, step), its recorded declaration digest is the current one, it has no marker
yet, the task has no per-task participant rows, every engine-owned action of the declaration is
`clear_decisions` or `queue_run_for_each_participant` served by the built-in executor, every participant the
fan-out matches has an agent, and no idempotency key the fan-out would write is taken. Those entries of one
(workflow, step) are finished together in one savepoint: one DELETE for the clears, one multi-row runs
insert (`ON CONFLICT DO NOTHING`), one multi-row marker insert, one terminal UPDATE. The rows are built by
SQLite from the entries' identities and the step's plan (idempotency keys included, byte for byte the keys
`OnEnterDispatch.context` builds), so no per-run value is built in Python. Any anomaly (a row missing, a
database error that does not end the transaction) rolls the savepoint back and leaves every entry of the
group to the per-entry path, which decides it exactly as before; an error that ends the transaction is
re-raised (issue 11 item 4). The effects and events are those the executors build.
Source: issue 14 item "Recovery: set-oriented SQL for the common case"; on-enter-action-dispatch.md AC-B9.
"""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from collections.abc import Iterable, Sequence

import attrs

from onceflow import metrics
from onceflow.actors.engine.actions import dedupe_seats
from onceflow.actors.engine.common import (
    Anomaly,
    Done,
    common_order,
    common_result,
    digest,
    fan_out_notes,
    reason,
    run_key,
)
from onceflow.actors.engine.on_enter import OnEnterDispatch, SegmentResult
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.kernel.services import Services
from onceflow.logs import get_logger
from onceflow.protocol.workflow import ActionDecl, Step, Workflow
from onceflow.store import faults, tasks
from onceflow.store.participants import template_participants
from onceflow.store.records import StepEntry, TaskRecord
from onceflow.store.runs import payload_json
from onceflow.store.savepoint import savepoint
from onceflow.store.step_entries import EntryKey, declaration_digest

log = get_logger("onceflow.recovery")

_WITH = (
    " WITH e (n, task_id, entry_seq) AS MATERIALIZED"
    " (SELECT key, value ->> 0, CAST(value ->> 1 AS INTEGER) FROM json_each(?2)),"
    " r (n, suffix, agent, reason, payload) AS MATERIALIZED"
    " (SELECT key, value ->> 1, value ->> 2, value ->> 3, value ->> 4 FROM json_each(?3)),"
    " pos (position, kind) AS MATERIALIZED"
    " (SELECT CAST(value ->> 0 AS INTEGER), value ->> 1 FROM json_each(?3)) "
)
"""The statements' operands, ?1 the step id: `e` the entries (`_entries`, ?2); ?3 either the runs of one
entry, `r` (`Group.runs`), or the positions of one entry, `pos` (`Group.kinds`). Materialized: each JSON
value is read once, not once per row it joins (SQLite 3.40 parses a JSON argument again at every `->>`,
and a `json_each` on the inner side of a join again for every outer row)."""

_KEY = "'on_enter:' || e.task_id || ':' || ?1 || ':' || e.entry_seq || r.suffix"
"""An on_enter idempotency key in SQL, for entry `e` of step ?1 and run `r`: SQLite writes an integer
entry_seq as Python's `str` does, so the key is `run_key`'s (compared byte for byte by the tests)."""


@attrs.frozen
class Group:
    """The set plan of one (workflow, step): its recovery order, per fan-out position the agents it queues
    for (template participants, deduplicated, in order), and the same as JSON parameters: `runs`, one
    [position, key suffix (":position:agent:config digest"), agent, reason, payload JSON] per run of an
    entry in dispatch order, and `kinds`, one [position, action type] per position. `notes`: the
    diagnostics an entry's fan-outs return, (level, code, fields but task_id) in order; `queued`: the runs
    an entry queues."""

    workflow: Workflow
    step: Step
    order: tuple[tuple[int, ActionDecl], ...]
    agents: dict[int, tuple[str, ...]]
    runs: str
    kinds: str
    notes: tuple[tuple[str, str, dict[str, object]], ...]
    queued: int


@attrs.frozen
class SetRun:
    """Entries of `group` the set path finished in one savepoint, in batch order. `detailed`, per entry,
    the dispatch that publishes it and what each position did (the decisions its clear deleted, an int, or
    the runs its fan-out queued, (agent_profile_id, run_id, idempotency_key) in participant order): read
    back only when someone could receive the events (`Outbox.has_audience` when the run was finished), else
    empty, and every fan-out queued one run per agent of the group."""

    group: Group
    entries: tuple[StepEntry, ...]
    detailed: tuple[tuple[OnEnterDispatch, Done], ...] = ()

    def results(self) -> list[SegmentResult]:
        """Per detailed entry, the `SegmentResult` the per-entry path builds: the executors' effects and
        events."""
        step, order = self.group.step, self.group.order
        return [common_result(d.task.id, step, order, done) for d, done in self.detailed]

    def publish(self, out: Outbox) -> int:
        """Publish what every entry did, in order; how many entries that is. Detailed: exactly the
        per-entry path's events and diagnostics (`results`). Else (the scan runs before `open_runtime`
        yields, so at startup nobody can subscribe): the same diagnostics logged and the same runs counted,
        no event built."""
        if self.detailed:
            for (dispatch, _), result in zip(self.detailed, self.results(), strict=True):
                dispatch.publish_segment(result)
            return len(self.entries)
        notes = self.group.notes
        for entry in self.entries:
            for level, code, fields in notes:
                out.log(level, code, task_id=entry.task_id, **fields)
        if self.group.queued:
            metrics.RUNS.add(self.group.queued * len(self.entries), {"result": "queued"})
        return len(self.entries)


def plan_common(
    conn: sqlite3.Connection, services: Services, batch: Sequence[tuple[StepEntry, int]]
) -> dict[int, Group]:
    """Which entries of `batch` the set path may finish, by index, with their group (writer thread; reads
    only, one query per (workflow, step)).

    An entry qualifies when it is the latest of its (task, step), its digest is current, `common_order`
    accepts its step, its task is at that step in that workflow with no per-task participant, it has no
    marker, every participant its fan-outs match has an agent, and none of its keys was merged into a run by
    coalescing.
    """
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for index, (entry, latest) in enumerate(batch):
        if latest == entry.entry_seq:
            groups[(entry.workflow_id, entry.step_id)].append(index)
    members: dict[int, Group] = {}
    any_merged = bool(groups) and _any_merged_on_enter_key(conn)
    for (workflow_id, step_id), indexes in groups.items():
        group = _group(conn, services, workflow_id, step_id)
        if group is None:
            continue
        digest = declaration_digest([a.type for a in group.step.events.on_enter])
        candidates = [i for i in indexes if batch[i][0].declaration_digest == digest]
        if not candidates:
            continue
        merged = (  # a key of these entries merged into an earlier run: only probed when any on_enter key was
            " AND NOT EXISTS (SELECT 1 FROM r CROSS JOIN coalesced_keys AS k ON k.idempotency_key = "
            + _KEY
            + ")"
            if any_merged
            else ""
        )
        rows = conn.execute(
            _WITH.lstrip() + "SELECT e.n FROM e CROSS JOIN tasks AS t ON t.id = e.task_id"
            " WHERE t.workflow_id = ?4 AND t.workflow_step_id = ?1"
            " AND NOT EXISTS (SELECT 1 FROM step_entry_markers AS m WHERE m.task_id = t.id AND m.step_id = ?1"
            " AND m.entry_seq = e.entry_seq)"
            " AND NOT EXISTS (SELECT 1 FROM participants AS p WHERE p.task_id = t.id)" + merged,
            (step_id, _entries(batch[i][0] for i in candidates), group.runs, workflow_id),
        ).fetchall()
        members.update((candidates[at], group) for (at,) in rows)
    return members


def _any_merged_on_enter_key(conn: sqlite3.Connection) -> bool:
    """Whether coalescing merged any on_enter key into a run (one index probe; the keys start "on_enter:")."""
    return (
        conn.execute(
            "SELECT 1 FROM coalesced_keys"
            " WHERE idempotency_key >= 'on_enter:' AND idempotency_key < 'on_enter;' LIMIT 1"
        ).fetchone()
        is not None
    )


def _entries(entries: Iterable[StepEntry]) -> str:
    """The JSON parameter naming entries: [[task_id, entry_seq], ...]."""
    return json.dumps([[e.task_id, e.entry_seq] for e in entries])


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
    runs: list[tuple[int, str, str, str, str | None]] = []
    for position, action in order:
        if action.type == "queue_run_for_each_participant":
            role: str = action.config.role  # type: ignore[union-attr]
            matching = dedupe_seats(p for p in template if p.role == role)
            if any(not p.agent_profile_id for p in matching):
                return None  # a participant failure: the per-entry path reports it
            agents[position] = tuple(p.agent_profile_id for p in matching)
            suffix, why = f":{position}:{{}}:{digest(action)}", reason(action)
            payload = payload_json(getattr(action.config, "payload", None))
            runs.extend((position, suffix.format(a), a, why, payload) for a in agents[position])
    kinds = json.dumps([[position, action.type] for position, action in order])
    notes = tuple(
        (note.level, note.code, {k: v for k, v in note.fields.items() if k != "task_id"})
        for position, action in order
        if position in agents
        for note in fan_out_notes("", step, action, len(agents[position]))
    )
    return Group(workflow, step, tuple(order), agents, json.dumps(runs), kinds, notes, len(runs))


def finish_common(
    conn: sqlite3.Connection,
    services: Services,
    group: Group,
    entries: Sequence[StepEntry],
    now: float,
    out: Outbox,
) -> SetRun | None:
    """Finish `entries` (consecutive in the batch, all planned into `group`) in one savepoint; None when an
    anomaly rolled it back, leaving them to the per-entry path. What each entry did is read back (run ids,
    clear counts, task rows) only when `out` has an audience for its events.

    Raises:
        sqlite3.Error: an error that ended the transaction (`faults.ends_transaction`).
    """
    try:
        with savepoint(conn, "recover_set"):
            if not out.has_audience():
                _finish(conn, group, entries, now, detailed=False)
                return SetRun(group, tuple(entries))
            done = _finish(conn, group, entries, now, detailed=True)
            assert done is not None
            found = _tasks(conn, entries)
    except Exception as exc:
        if faults.ends_transaction(conn, exc):
            raise
        log.info(
            "recovery_set_path_declined",
            workflow_id=group.workflow.id,
            step_id=group.step.id,
            cause=repr(exc),
        )
        return None
    dispatches = (
        OnEnterDispatch(services, found[e.task_id], group.workflow, group.step, _key(e), "recovery", out)
        for e in entries
    )
    return SetRun(group, tuple(entries), tuple(zip(dispatches, done, strict=True)))


def _key(entry: StepEntry) -> EntryKey:
    return EntryKey(entry.task_id, entry.step_id, entry.entry_seq)


def _tasks(conn: sqlite3.Connection, entries: Sequence[StepEntry]) -> dict[str, TaskRecord]:
    columns = ", ".join(f"t.{c.strip()}" for c in tasks.TASK_COLUMNS.split(","))
    rows = conn.execute(
        f"SELECT {columns} FROM json_each(?) AS e CROSS JOIN tasks AS t ON t.id = e.value ->> 0",
        (_entries(entries),),
    ).fetchall()
    return {task.id: task for task in map(tasks.task_from_row, rows)}


def _finish(
    conn: sqlite3.Connection, group: Group, members: Sequence[StepEntry], now: float, *, detailed: bool
) -> list[Done] | None:
    """The group's actions for every member entry, set-oriented; `detailed`: what each position did, per
    member (else None).

    Raises:
        Anomaly: a statement touched other rows than the plan says (a key already taken, an entry closed).
    """
    step_id = group.step.id
    entries = _entries(members)
    counts: dict[str, int] = {}
    if any(action.type == "clear_decisions" for _, action in group.order):
        counts = _clear(conn, step_id, entries, detailed=detailed)
    ids: dict[str, int] = {}
    if group.agents:
        ids = _insert_runs(conn, step_id, entries, group, len(members), now, detailed=detailed)
    conn.execute(
        "INSERT INTO step_entry_markers (task_id, step_id, entry_seq, position, kind, state, epoch, detail,"
        " updated_at)"
        + _WITH
        + "SELECT e.task_id, ?1, e.entry_seq, pos.position, pos.kind, 'done', NULL, '', ?4"
        " FROM e CROSS JOIN pos",
        (step_id, entries, group.kinds, now),
    )
    terminal = conn.execute(
        "UPDATE step_entries SET terminal = 1 WHERE step_id = ?1 AND terminal = 0"
        " AND (task_id, entry_seq) IN (SELECT value ->> 0, CAST(value ->> 1 AS INTEGER) FROM json_each(?2))",
        (step_id, entries),
    ).rowcount
    if terminal != len(members):
        raise Anomaly(f"{terminal} entries flagged terminal of {len(members)}")
    if not detailed:
        return None
    done: list[Done] = []
    for m in members:
        did: list[tuple[int, int | tuple[tuple[str, int, str], ...]]] = []
        for position, action in group.order:
            if position not in group.agents:
                did.append((position, counts.get(m.task_id, 0)))
                continue
            keys = [(agent, run_key(_key(m), position, agent, action)) for agent in group.agents[position]]
            if any(key not in ids for _, key in keys):
                raise Anomaly("a run key the set statement did not write")
            did.append((position, tuple((agent, ids[key], key) for agent, key in keys)))
        done.append(tuple(did))
    return done


def _clear(conn: sqlite3.Connection, step_id: str, entries: str, *, detailed: bool) -> dict[str, int]:
    """Delete the step's decisions of every entry's task in one statement; `detailed`: the count deleted
    per task (else empty)."""
    counts: dict[str, int] = {}
    if detailed:
        counts = dict(
            conn.execute(
                "SELECT task_id, COUNT(*) FROM decisions WHERE step_id = ?"
                " AND task_id IN (SELECT value ->> 0 FROM json_each(?)) GROUP BY task_id",
                (step_id, entries),
            ).fetchall()
        )
    deleted = conn.execute(
        "DELETE FROM decisions WHERE step_id = ? AND task_id IN (SELECT value ->> 0 FROM json_each(?))",
        (step_id, entries),
    ).rowcount
    if detailed and deleted != sum(counts.values()):
        raise Anomaly(f"deleted {deleted} decisions, counted {sum(counts.values())}")
    return counts


def _insert_runs(
    conn: sqlite3.Connection,
    step_id: str,
    entries: str,
    group: Group,
    members: int,
    now: float,
    *,
    detailed: bool,
) -> dict[str, int]:
    """One multi-row insert of every entry's queued runs, in entry then dispatch order (the per-entry path's
    order, so the same run ids); `detailed`: the run id per key (else empty).

    Raises:
        Anomaly: a key was already taken (its row was not inserted).
    """
    expected = members * sum(len(agents) for agents in group.agents.values())
    cursor = conn.execute(
        "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, payload, idempotency_key,"
        " exclude_from_coalescing, requested_at)" + _WITH + f"SELECT r.agent, e.task_id, ?1, r.reason,"
        f" r.payload, {_KEY}, 1, ?4 FROM e CROSS JOIN r WHERE true ORDER BY e.n, r.n"
        " ON CONFLICT (idempotency_key) DO NOTHING" + (" RETURNING idempotency_key, id" if detailed else ""),
        (step_id, entries, group.runs, now),
    )
    if detailed:
        ids = dict(cursor.fetchall())
        inserted = len(ids)
    else:
        ids, inserted = {}, cursor.rowcount
    if inserted != expected:
        raise Anomaly(f"{expected - inserted} idempotency keys already taken")
    return ids
