"""The recovery scan's common case, set-oriented: many untouched open entries finished by a few statements.
Writer thread: every function runs inside the writer's transaction, on plans handed in by the Trio side.

An open entry is "common" when its task still stands at the entry's step in the entry's workflow, the entry
is the latest of its (task, step), its recorded declaration digest is the current one, it has no marker
yet, the task has no per-task participant rows, every engine-owned action of the declaration is
`clear_decisions` or `queue_run_for_each_participant` served by the built-in executor, every participant the
fan-out matches has an agent, and no idempotency key the fan-out would write is taken. Those entries of one
(workflow, step) are finished together in one savepoint: one DELETE for the clears, one multi-row runs
insert (`ON CONFLICT DO NOTHING`), one multi-row marker insert, one terminal UPDATE. The rows are built by
the database from the entries' identities and the step's plan (idempotency keys included, byte for byte
the keys the executors build: store/runs/keys.py), so no per-run value is built in Python. Any anomaly (a row
missing, a database error other than a storage fault) rolls the savepoint back and leaves every entry of
the group to the per-entry path, which decides it exactly as before; a storage fault, or an error that ends
the transaction, is re-raised (`faults.fails_request`). What each entry did is returned as data; the Trio
side publishes the events the executors would have (actors/engine/recovery.py). Source:
on-enter-action-dispatch.md AC-B9.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import attrs

from onceflow.observability.logs import get_logger
from onceflow.protocol.workflow import ActionDecl, Step, Workflow
from onceflow.store.backends import faults
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.dialect import Dialect, Sql
from onceflow.store.backends.savepoint import savepoint
from onceflow.store.entries.common_entry import Anomaly, Done
from onceflow.store.entries.executors import Executor, fan_out_digest, fan_out_notes, fan_out_reason
from onceflow.store.entries.participants import dedupe_seats, template_participants
from onceflow.store.entries.step_entries import declaration_digest
from onceflow.store.records import StepEntry, TaskRecord
from onceflow.store.runs import digests, keys
from onceflow.store.runs.runs import payload_json
from onceflow.store.tasks import tasks

log = get_logger("onceflow.recovery")


def _with(d: Dialect) -> str:
    """The statements' operands, ?1 the step id: `e` the entries (`_entries`, ?2); ?3 either the runs of one
    entry, `r` (`Group.runs`), or the positions of one entry, `pos` (`Group.kinds`). Materialized: each JSON
    value is read once, not once per row it joins (SQLite 3.40 parses a JSON argument again at every `->>`,
    and a `json_each` on the inner side of a join again for every outer row)."""
    return (
        " WITH e (n, task_id, entry_seq) AS MATERIALIZED"
        f" (SELECT key, value ->> 0, CAST(value ->> 1 AS INTEGER) FROM {d.json_rows('?2')}),"
        " r (n, suffix, agent, reason, payload, position, digest) AS MATERIALIZED"
        " (SELECT key, value ->> 1, value ->> 2, value ->> 3, value ->> 4, CAST(value ->> 0 AS INTEGER),"
        f" value ->> 5 FROM {d.json_rows('?3')}),"
        " pos (position, kind) AS MATERIALIZED"
        f" (SELECT CAST(value ->> 0 AS INTEGER), value ->> 1 FROM {d.json_rows('?3')}) "
    )


_KEY = keys.entry_prefix_sql("e.task_id", "?1", "e.entry_seq") + " || r.suffix"
"""An on_enter idempotency key in SQL, for entry `e` of step ?1 and run `r` (`keys.entry_key`'s bytes: an
integer entry_seq is written as Python's `str` writes it)."""

Order = tuple[tuple[int, ActionDecl], ...]


@attrs.frozen
class StepPlan:
    """What the recovery scan takes of one (workflow, step) of the loaded templates, planned on the Trio
    side: the step, its recovery dispatch order (engine-owned actions), whether any of them waits on the
    host (`deferred`: no executor, or run_code_review), its `common_order` on the recovery path (None: not
    a set-path step), and the executors."""

    workflow: Workflow
    step: Step
    order: Order
    deferred: bool
    common: Order | None
    executors: Mapping[str, Executor]


StepPlans = Mapping[tuple[str, str, int], StepPlan]
"""(workflow_id, step_id, workflow version) → its `StepPlan`; a key missing from it no longer resolves."""


@attrs.frozen
class Group:
    """The set plan of one (workflow, step): its recovery order, per fan-out position the agents it queues
    for (template participants, deduplicated, in order), and the same as JSON parameters: `runs`, one
    [position, key suffix (`keys.entry_suffix`), agent, reason, payload JSON, config digest] per run of an
    entry in dispatch order, and `kinds`, one [position, action type] per position. `notes`: the diagnostics
    an entry's fan-outs return, (level, code, fields but task_id) in order; `queued`: the runs an entry
    queues."""

    workflow_id: str
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
    its task and what each position did (the decisions its clear deleted, an int, or the runs its fan-out
    queued, (agent_profile_id, run_id, idempotency_key) in participant order): read back only when someone
    could receive the events (`audience` when the run was finished), else empty, and every fan-out queued
    one run per agent of the group."""

    group: Group
    entries: tuple[StepEntry, ...]
    detailed: tuple[tuple[TaskRecord, Done], ...] = ()


def _plan(d: Dialect, merged: bool) -> str:
    return (
        _with(d).lstrip() + f"SELECT e.n FROM e {d.join} tasks AS t ON t.id = e.task_id"
        " WHERE t.workflow_id = ?4 AND t.workflow_step_id = ?1 AND t.workflow_version = ?5"
        " AND NOT EXISTS (SELECT 1 FROM step_entry_markers AS m WHERE m.task_id = t.id AND m.step_id = ?1"
        " AND m.entry_seq = e.entry_seq)"
        " AND NOT EXISTS (SELECT 1 FROM participants AS p WHERE p.task_id = t.id)"
        # a key of these entries merged into an earlier run, or held as text by a run of another trigger:
        # only probed when some on_enter key is
        + (
            f" AND NOT EXISTS (SELECT 1 FROM r {d.join} coalesced_keys AS k ON k.idempotency_key = {_KEY})"
            f" AND NOT EXISTS (SELECT 1 FROM r {d.join} runs AS o ON o.idempotency_key = {_KEY})"
            if merged
            else ""
        )
    )


_PLAN = {merged: Sql.of(functools.partial(_plan, merged=merged)) for merged in (False, True)}
"""`plan_common`'s query of one group (?1 step, ?2 entries, ?3 runs, ?4 workflow, ?5 version): the
qualifying entries' indexes; by whether any on_enter key was merged by coalescing."""


def plan_common(
    conn: Connection, plans: StepPlans, batch: Sequence[tuple[StepEntry, int]]
) -> dict[int, Group]:
    """Which entries of `batch` the set path may finish, by index, with their group (writer thread; reads
    only, one query per (workflow, step)).

    An entry qualifies when it is the latest of its (task, step), its digest is current, `common_order`
    accepts its step, its task is at that step in that workflow with no per-task participant, it has no
    marker, every participant its fan-outs match has an agent, and none of its keys was merged into a run by
    coalescing.
    """
    groups: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for index, (entry, latest) in enumerate(batch):
        if latest == entry.entry_seq:
            groups[(entry.workflow_id, entry.step_id, entry.workflow_version)].append(index)
    members: dict[int, Group] = {}
    any_merged = bool(groups) and _any_merged_on_enter_key(conn)
    for (workflow_id, step_id, version), indexes in groups.items():
        group = _group(conn, plans.get((workflow_id, step_id, version)))
        if group is None:
            continue
        digest = declaration_digest([a.type for a in group.step.events.on_enter])
        candidates = [i for i in indexes if batch[i][0].declaration_digest == digest]
        if not candidates:
            continue
        rows = conn.execute(
            _PLAN[any_merged].on(conn),
            (step_id, _entries(batch[i][0] for i in candidates), group.runs, workflow_id, version),
        ).fetchall()
        members.update((candidates[at], group) for (at,) in rows)
    return members


def _any_merged_on_enter_key(conn: Connection) -> bool:
    """Whether coalescing merged any on_enter key into a run, or a run holds one as its text (not by its
    parts: a run of another trigger); two index probes, the keys start "on_enter:"."""
    return (
        conn.execute(
            "SELECT 1 FROM coalesced_keys WHERE idempotency_key >= ?1 AND idempotency_key < ?2"
            " UNION ALL SELECT 1 FROM runs WHERE idempotency_key >= ?1 AND idempotency_key < ?2 LIMIT 1",
            keys.ON_ENTER_RANGE,
        ).fetchone()
        is not None
    )


def _entries(entries: Iterable[StepEntry]) -> str:
    """The JSON parameter naming entries: [[task_id, entry_seq], ...]."""
    return json.dumps([[e.task_id, e.entry_seq] for e in entries])


def _group(conn: Connection, plan: StepPlan | None) -> Group | None:
    if plan is None or plan.common is None:
        return None
    step, order, workflow_id = plan.step, plan.common, plan.workflow.id
    template = template_participants(conn, workflow_id=workflow_id, step_id=step.id)
    agents: dict[int, tuple[str, ...]] = {}
    runs: list[tuple[int, str, str, str, str | None, str]] = []
    notes: list[tuple[str, str, dict[str, object]]] = []
    for position, action in order:
        if action.type != "queue_run_for_each_participant":
            continue
        role: str = getattr(action.config, "role", "")
        matching = dedupe_seats(p for p in template if p.role == role)
        if any(not p.agent_profile_id for p in matching):
            return None  # a participant failure: the per-entry path reports it
        agents[position] = seated = tuple(p.agent_profile_id for p in matching)
        why = fan_out_reason(action, "on_enter")
        digest = fan_out_digest(action, why)
        payload = payload_json(getattr(action.config, "payload", None))
        runs.extend(
            (position, keys.entry_suffix(position, a, digest), a, why, payload, digest) for a in seated
        )
        for note in fan_out_notes("", step.id, step.name, role, len(seated), len(seated)):
            notes.append((note.level, note.code, {k: v for k, v in note.fields.items() if k != "task_id"}))
    kinds = json.dumps([[position, action.type] for position, action in order])
    return Group(workflow_id, step, tuple(order), agents, json.dumps(runs), kinds, tuple(notes), len(runs))


def finish_common(
    conn: Connection, group: Group, entries: Sequence[StepEntry], now: float, audience: bool
) -> SetRun | None:
    """Finish `entries` (consecutive in the batch, all planned into `group`) in one savepoint; None when an
    anomaly rolled it back, leaving them to the per-entry path. What each entry did is read back (run ids,
    clear counts, task rows) only when the events have an `audience` (`Outbox.has_audience`).

    Raises:
        sqlite3.Error: a storage fault, or an error that ended the transaction (`faults.fails_request`).
    """
    try:
        with savepoint(conn, "recover_set"):
            if not audience:
                _finish(conn, group, entries, now, detailed=False)
                return SetRun(group, tuple(entries))
            done = _finish(conn, group, entries, now, detailed=True)
            assert done is not None
            found = _tasks(conn, entries)
    except Exception as exc:
        if faults.fails_request(conn, exc):
            raise
        step_id = group.step.id
        log.info(
            "recovery_set_path_declined", workflow_id=group.workflow_id, step_id=step_id, cause=repr(exc)
        )
        return None
    return SetRun(group, tuple(entries), tuple(zip((found[e.task_id] for e in entries), done, strict=True)))


_COLUMNS = ", ".join(f"t.{c.strip()}" for c in tasks.TASK_COLUMNS.split(","))
_TASKS = Sql.of(
    lambda d: f"SELECT {_COLUMNS} FROM {d.json_rows('?1', 'e')} {d.join} tasks AS t ON t.id = e.value ->> 0"
)


def _tasks(conn: Connection, entries: Sequence[StepEntry]) -> dict[str, TaskRecord]:
    rows = conn.execute(_TASKS.on(conn), (_entries(entries),)).fetchall()
    return {task.id: task for task in map(tasks.task_from_row, rows)}


_MARKERS = Sql.of(
    lambda d: (
        "INSERT INTO step_entry_markers (task_id, step_id, entry_seq, position, kind, state, epoch,"
        " detail, updated_at)"
        + _with(d)
        + "SELECT e.task_id, ?1, e.entry_seq, pos.position, pos.kind, 'done', NULL, '', ?4"
        " FROM e CROSS JOIN pos"
    )
)
_TERMINAL = Sql.of(
    lambda d: (
        "UPDATE step_entries SET terminal = 1 WHERE step_id = ?1 AND terminal = 0"
        " AND (task_id, entry_seq) IN"
        f" (SELECT value ->> 0, CAST(value ->> 1 AS INTEGER) FROM {d.json_rows('?2')})"
    )
)


def _finish(
    conn: Connection, group: Group, members: Sequence[StepEntry], now: float, *, detailed: bool
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
    conn.execute(_MARKERS.on(conn), (step_id, entries, group.kinds, now))
    terminal = conn.execute(_TERMINAL.on(conn), (step_id, entries)).rowcount
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
            digest = fan_out_digest(action, fan_out_reason(action, "on_enter"))
            made = [
                (agent, keys.entry_key(m.task_id, m.step_id, m.entry_seq, position, agent, digest))
                for agent in group.agents[position]
            ]
            if any(key not in ids for _, key in made):
                raise Anomaly("a run key the set statement did not write")
            did.append((position, tuple((agent, ids[key], key) for agent, key in made)))
        done.append(tuple(did))
    return done


_COUNTS = Sql.of(
    lambda d: (
        "SELECT task_id, COUNT(*) FROM decisions WHERE step_id = ?1"
        f" AND task_id IN (SELECT value ->> 0 FROM {d.json_rows('?2')}) GROUP BY task_id"
    )
)
_CLEAR = Sql.of(
    lambda d: (
        "DELETE FROM decisions WHERE step_id = ?1"
        f" AND task_id IN (SELECT value ->> 0 FROM {d.json_rows('?2')})"
    )
)


def _clear(conn: Connection, step_id: str, entries: str, *, detailed: bool) -> dict[str, int]:
    """Delete the step's decisions of every entry's task in one statement; `detailed`: the count deleted
    per task (else empty)."""
    counts: dict[str, int] = {}
    if detailed:
        counts = dict(conn.execute(_COUNTS.on(conn), (step_id, entries)).fetchall())
    deleted = conn.execute(_CLEAR.on(conn), (step_id, entries)).rowcount
    if detailed and deleted != sum(counts.values()):
        raise Anomaly(f"deleted {deleted} decisions, counted {sum(counts.values())}")
    return counts


def _insert_runs_sql(d: Dialect, detailed: bool) -> str:
    return (
        "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, payload, key_position,"
        " key_digest, exclude_from_coalescing, requested_at, trigger, entry_seq, admission_seq)"
        + _with(d)
        + "SELECT r.agent, e.task_id, ?1, r.reason, r.payload, r.position,"
        f" {digests.id_sql('r.digest')}, 1, ?4,"
        " CASE r.reason WHEN 'on_enter' THEN '' ELSE 'on_enter' END, e.entry_seq,"
        " (SELECT admissions FROM tasks WHERE id = e.task_id)"
        " FROM e CROSS JOIN r WHERE true ORDER BY e.n, r.n"
        f" ON CONFLICT ({keys.ENTRY_KEY_COLUMNS}) DO NOTHING"
        + (f" RETURNING {keys.STORED_KEY_SQL}, id" if detailed else "")
    )


_INSERT_RUNS = {
    detailed: Sql.of(functools.partial(_insert_runs_sql, detailed=detailed)) for detailed in (False, True)
}
"""`_insert_runs`' statement, by whether it answers each run's key and id."""


def _insert_runs(
    conn: Connection,
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
    digests.keep(conn, sorted(run[5] for run in json.loads(group.runs)))
    cursor = conn.execute(_INSERT_RUNS[detailed].on(conn), (step_id, entries, group.runs, now))
    if detailed:
        ids = dict(cursor.fetchall())
        inserted = len(ids)
    else:
        ids, inserted = {}, cursor.rowcount
    if inserted != expected:
        raise Anomaly(f"{expected - inserted} idempotency keys already taken")
    return ids
