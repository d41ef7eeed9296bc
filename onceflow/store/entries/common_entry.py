"""The common step entry: an on_enter of built-in clears and fan-outs only, written in one savepoint.
Writer thread: every function runs inside the writer's transaction; the Trio side plans which entries are
common and publishes what they did (actors/engine/common.py).

Most entries declare nothing but `clear_decisions` and `queue_run_for_each_participant` (served by the
built-in executors). For those the admitting request runs in one savepoint (the writer's per-request one,
`request_savepoint`): the step compare-and-set, the entry insert (already terminal: the savepoint either
finishes the entry or leaves no trace), the clear, one multi-row marker insert, one multi-row runs insert
that reads the participants itself (`_RUNS`) and the transition of the task's history (six statements).
Any anomaly (the task moved, the step is at its WIP limit, a seat without an agent, an idempotency key
already taken or merged by coalescing, any database error other than a storage fault) rolls back to that
savepoint and the caller takes the per-action path, which decides it exactly as before; a storage fault, or
an error that ends the transaction, is re-raised (`faults.fails_request`).
The writer returns plain data (`Admitted`); after the commit the caller publishes the
events the executors would have. Entries of one step that share a writer batch are admitted together
(`admit_group`: the same six statements for all of them; on SQLite two reads instead of RETURNING, on
PostgreSQL, where other runtimes insert runs meanwhile, RETURNING); any anomaly rolls the group back and
each is decided alone, as above. Source: on-enter-action-dispatch.md AC-B5,
AC-B6, AC-B7, AC-C1, AC-A3, AC-A5.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from onceflow.observability.logs import get_logger
from onceflow.protocol.events import EntryPath
from onceflow.protocol.workflow import ActionDecl, Step
from onceflow.store.backends import faults
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.dialect import POSTGRES, Sql
from onceflow.store.backends.savepoint import request_savepoint
from onceflow.store.backends.urls import on_postgres
from onceflow.store.entries import wip
from onceflow.store.entries.executors import fan_out_digest, fan_out_reason
from onceflow.store.entries.participants import seats_sql
from onceflow.store.entries.step_entries import EntryKey, declaration_digest, done_markers
from onceflow.store.records import TaskRecord
from onceflow.store.runs import digests, flow, keys, runs
from onceflow.store.runs.runs import Change, payload_json
from onceflow.store.tasks import history, tasks

log = get_logger("onceflow.on_enter")

COMMON_KINDS = ("clear_decisions", "queue_run_for_each_participant")

Queued = tuple[tuple[str, int, str], ...]
"""The runs a fan-out queued: (agent_profile_id, run_id, idempotency_key) in participant order."""

Done = tuple[tuple[int, int | Queued], ...]
"""Per position in dispatch order: what its clear deleted (a count), or the runs its fan-out queued."""


class Anomaly(Exception):
    """The common path cannot decide this entry alone: the per-action path must."""


@attrs.frozen
class Admitted:
    """A common entry admitted and finished in one savepoint: its key, what each position did, and the runs
    of the entry it left (cancelled, or superseded when claimed)."""

    key: EntryKey
    done: Done
    left: tuple[Change, ...] = ()


@attrs.frozen
class Plan:
    """What a common entry's statements take from its step and dispatch order alone: built once per
    (step, path) by the engine's entry-plan memo and reused by every entry (no per-entry JSON, digest or
    reason in the writer).

    `declaration`: the step's declaration digest; `clears`: whether the order
    has a clear; `done`: its done markers as the entry row keeps them (`step_entries.done_markers`);
    `fan_outs`: the runs statement's JSON, one [role, key head, key tail (`keys.suffix_around` of its
    position and config digest), reason, payload JSON, position, config digest] per fan-out in dispatch
    order ('' when there is none); `digests`: the declaration's and config digests as `digests.keep_rows`
    takes them."""

    step: Step
    order: tuple[tuple[int, ActionDecl], ...]
    declaration: str
    clears: bool
    done: str
    fan_outs: str
    digests: str = ""


def common_plan(step: Step, order: tuple[tuple[int, ActionDecl], ...]) -> Plan:
    """The `Plan` of `step` entered in `order` (its `common_order` on some path)."""
    fan_outs = []
    for position, action in order:
        if action.type == "queue_run_for_each_participant":
            reason = fan_out_reason(action, "on_enter")
            payload: dict[str, Any] | None = getattr(action.config, "payload", None)
            role: str = getattr(action.config, "role", "")
            digest = fan_out_digest(action, reason)
            head, tail = keys.suffix_around(position, digest)
            fan_outs.append([role, head, tail, reason, payload_json(payload), position, digest])
    return Plan(
        step,
        order,
        declaration := declaration_digest([a.type for a in step.events.on_enter]),
        any(a.type == "clear_decisions" for _, a in order),
        done_markers([(p, a.type) for p, a in order]),
        json.dumps(fan_outs) if fan_outs else "",
        digests.rows([declaration, *sorted(str(fan_out[6]) for fan_out in fan_outs)]),
    )


def admit_common(
    conn: Connection,
    *,
    task: TaskRecord,
    workflow_id: str,
    plan: Plan,
    path: EntryPath,
    now: float,
    version: tuple[str, bool, int] | None = None,
    trigger: str = "",
    operation_id: str = "",
) -> Admitted | None:
    """Admit `task` to `plan.step` and run its whole on_enter in one savepoint (writer thread); None when an
    anomaly rolled it back and nothing of it remains. It must be the first write of its writer request: the
    savepoint is the request's own (`request_savepoint`, two statements fewer per entry). `version` (a
    cached row's workflow id, admitted flag and admission count) is verified by the compare-and-set too
    (`tasks.move_task_step`). `trigger` and `operation_id` (what moved the task) go into its history's
    transition item (store/tasks/history.py). The caller publishes the events outside the writer.

    Raises:
        sqlite3.Error: a storage fault, or an error that ended the transaction (`faults.fails_request`).
    """
    try:
        with request_savepoint(conn):  # the first write of the admitting request (Engine.enter_step)
            return _admit(conn, task, workflow_id, plan, path, now, version, (trigger, operation_id))
    except Exception as exc:
        if faults.fails_request(conn, exc):
            raise
        if not isinstance(exc, Anomaly):
            log.info("common_entry_declined", task_id=task.id, step_id=plan.step.id, cause=repr(exc))
        return None


_RUNS = Sql.of(
    lambda d: (
        "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, payload, key_position,"
        " key_digest, exclude_from_coalescing, requested_at, trigger, entry_seq, admission_seq)"
        " WITH a (n, role, head, tail, reason, payload, position, digest) AS MATERIALIZED"
        " (SELECT key, value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4, value ->> 5,"
        f" value ->> 6 FROM {d.json_rows('?6')}),"
        " s (n, agent, reason, payload, k, position, id, key_position, digest) AS"
        " (SELECT a.n, p.agent_profile_id, a.reason, a.payload,"
        f" ?5 || {keys.suffix_around_sql('a.head', 'p.agent_profile_id', 'a.tail')}, p.position, p.id,"
        " a.position, a.digest"
        f" FROM a {d.join} {seats_sql(workflow='?4', step='?2', task='?1', role='a.role')})"
        " SELECT CASE WHEN s.agent = '' OR EXISTS (SELECT 1 FROM coalesced_keys AS c"
        " WHERE c.idempotency_key = s.k) OR EXISTS (SELECT 1 FROM runs AS o WHERE o.idempotency_key = s.k)"
        " THEN NULL ELSE s.agent END, ?1, ?2, s.reason, s.payload, CAST(s.key_position AS INTEGER),"
        f" {digests.id_sql('s.digest')},"
        " 1, ?3, CASE s.reason WHEN 'on_enter' THEN '' ELSE 'on_enter' END, ?7,"
        " (SELECT admissions FROM tasks WHERE id = ?1)"
        " FROM s ORDER BY s.n, s.position, s.id"
        f" RETURNING id, agent_profile_id, {keys.STORED_KEY_SQL}"
    )
)
"""Every fan-out's runs in one statement, built by the database from the participant rows (read in this
statement alone: a concurrent add/remove never splits a fan-out, AC-F2) and the plan's `fan_outs` (?6):
per fan-out its seats (`participants.seats_sql`: the rows of its role at step ?2 of workflow ?4, template
or task ?1's own, one per agent, AC-A5), in dispatch then (position, id) order, so the run ids are the
per-action path's. The key is ?5 (the entry's `keys.entry_prefix`) + `keys.entry_suffix`, byte for byte the
executor's, stored by its parts (store/runs/keys.py). A seat without an agent (AC-E2) or a key merged by
coalescing or taken as text (by a run of another trigger) writes a NULL agent and a key already taken by its
parts (AC-H6) violates `runs_by_entry_key`: either fails the statement (an IntegrityError, logged as
`common_entry_declined` at info), and the per-action path decides the entry. No `ON CONFLICT DO NOTHING`:
a row skipped silently could not be told from a seat that is not there."""


_ENTRY = (
    "INSERT INTO step_entries (task_id, step_id, entry_seq, workflow_id, declaration_digest, entry_path,"
    " terminal, created_at, done_markers) VALUES (?1, ?2, (SELECT COALESCE(MAX(entry_seq), 0) + 1"
    f" FROM step_entries WHERE task_id = ?1 AND step_id = ?2), ?3, {digests.id_sql('?4')}, ?5, 1, ?6, ?7)"
    " RETURNING entry_seq"
)
"""A common entry's terminal row, the next seq of its (task, step). `VALUES` with the seq as a scalar
subquery, not `INSERT ... SELECT ... FROM step_entries`: SQLite runs an insert that selects from its own
table through a temporary table (it must not see its own rows), twice the instructions."""


def _admit(
    conn: Connection,
    task: TaskRecord,
    workflow_id: str,
    plan: Plan,
    path: EntryPath,
    now: float,
    version: tuple[str, bool, int] | None,
    cause: tuple[str, str],
) -> Admitted:
    step = plan.step
    if plan.fan_outs and flow.rates_set(conn):
        raise Anomaly("an hourly rate to check per run")
    if step.wip_limit > 0 and not wip.place(conn, workflow_id, step, task_id=task.id).admitted:
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
    leaving = runs.leave_entries(conn, [task.id], now)
    digests.keep_rows(conn, plan.digests)
    (seq,) = conn.execute(
        _ENTRY, (task.id, step.id, workflow_id, plan.declaration, path, now, plan.done)
    ).fetchone()
    history.record_transition(conn, task.id, now, _transition(task, workflow_id, plan, path, seq, cause))
    deleted = 0
    if plan.clears:
        deleted = conn.execute(
            "DELETE FROM decisions WHERE task_id = ? AND step_id = ?", (task.id, step.id)
        ).rowcount
    prefix = keys.entry_prefix(task.id, step.id, seq)
    queued: dict[int, list[tuple[str, int, str]]] = {}
    if plan.fan_outs:
        params = (task.id, step.id, now, workflow_id, prefix, plan.fan_outs, seq)
        returned = conn.execute(_RUNS.on(conn), params).fetchall()
        returned.sort()  # by run id: the insertion order (RETURNING's own order is unspecified)
        for run_id, agent, run in returned:
            queued.setdefault(keys.position_in(run, prefix), []).append((agent, run_id, run))
    return Admitted(EntryKey(task.id, step.id, seq), _done(plan, deleted, queued), leaving.changes())


def _transition(
    task: TaskRecord, workflow_id: str, plan: Plan, path: EntryPath, seq: int, cause: tuple[str, str]
) -> str:
    """The history's transition detail of a common entry (store/tasks/history.py); `cause` (trigger, operation
    id)."""
    return history.transition_detail(
        from_step=task.step_id,
        to_step=plan.step.id,
        workflow_id=workflow_id,
        trigger=cause[0],
        operation_id=cause[1],
        path=path,
        entry_seq=seq,
    )


@attrs.frozen
class Admission:
    """One common entry of a group (`admit_group`): what `admit_common` takes for it."""

    task: TaskRecord
    workflow_id: str
    plan: Plan
    path: EntryPath
    now: float
    version: tuple[str, bool, int] | None
    trigger: str = ""
    operation_id: str = ""


class Admitting(Protocol):
    """What `admit_group` reads of each entry: an `Admission`'s fields (the writer's own requests,
    `admission.EntryRequest`, are given as they are: no object built per entry to carry them)."""

    @property
    def task(self) -> TaskRecord: ...
    @property
    def workflow_id(self) -> str: ...
    @property
    def plan(self) -> Plan: ...
    @property
    def path(self) -> EntryPath: ...
    @property
    def now(self) -> float: ...
    @property
    def version(self) -> tuple[str, bool, int] | None: ...
    @property
    def trigger(self) -> str: ...
    @property
    def operation_id(self) -> str: ...


def admit_group(conn: Connection, admissions: Sequence[Admitting]) -> list[Admitted] | None:
    """Admit several tasks to one step (one plan, workflow and path: `group_key`) and run their whole
    on_enter with one set of statements for all of them (writer thread, inside the writer's group savepoint):
    the result for each, in order, is the one `admit_common` gives it when the entries are admitted one after
    another in that order, run ids included. None when any of them would take the per-action path (a task
    moved or stale, a WIP limit, a seat without an agent, a key already taken or merged, any database error
    other than a storage fault, a task twice): the writer rolls the group back and each entry is decided
    alone.

    Raises:
        sqlite3.Error: a storage fault, or an error that ended the transaction (`faults.fails_request`).
    """
    first = admissions[0]
    try:
        return _admit_group(conn, first.plan, first.workflow_id, first.path, admissions)
    except Exception as exc:
        if faults.fails_request(conn, exc):
            raise
        if not isinstance(exc, Anomaly):
            step_id = first.plan.step.id
            log.info("common_entry_declined", step_id=step_id, group=len(admissions), cause=repr(exc))
        return None


_MOVE_GROUP = Sql.of(
    lambda d: (
        "UPDATE tasks SET workflow_version = CASE WHEN tasks.workflow_id = ?1"
        f" THEN tasks.workflow_version ELSE {tasks.NEWEST_VERSION.format(workflow='?1')} END,"
        " workflow_id = ?1, workflow_step_id = ?2, wip_admitted = 1, queued_for_step_id = NULL,"
        " queued_at = NULL, updated_at = CAST(m.value ->> 5 AS DOUBLE PRECISION), admissions = admissions + 1"
        f" FROM {d.json_rows('?3', 'm')} WHERE tasks.id = m.value ->> 0"
        " AND tasks.workflow_step_id = m.value ->> 1"
        " AND (m.value ->> 2 IS NULL OR (tasks.workflow_id = m.value ->> 2"
        " AND tasks.wip_admitted = CAST(m.value ->> 3 AS INTEGER)"
        " AND tasks.admissions = CAST(m.value ->> 4 AS INTEGER)))"
    )
)
"""`tasks.move_task_step` (admitted, a cached row's version verified when given) for every task of ?3:
[[task id, expected step id, version workflow id or null, admitted flag, admission count, now], ...]."""

_ENTRIES_GROUP_PG = (
    "INSERT INTO step_entries (task_id, step_id, entry_seq, workflow_id, declaration_digest, entry_path,"
    " terminal, created_at, done_markers) SELECT m.value ->> 0, ?1,"
    " (SELECT COALESCE(MAX(entry_seq), 0) + 1 FROM step_entries WHERE task_id = m.value ->> 0"
    f" AND step_id = ?1), ?2, {digests.id_sql('?3')}, ?4, 1,"
    f" CAST(m.value ->> 5 AS DOUBLE PRECISION), ?6 FROM {POSTGRES.json_rows('?5', 'm')} ORDER BY m.key"
    " RETURNING task_id, entry_seq"
)
"""One terminal entry per task of ?5 (`_MOVE_GROUP`'s rows), each the next seq of its (task, step ?1), with
the plan's done markers ?6, answering each new entry's seq (PostgreSQL): a read of the largest run id
(`_SEQS_GROUP`) would not bound this transaction's runs there, where other runtimes insert runs meanwhile."""

_CLEAR_GROUP = Sql.of(
    lambda d: (
        "DELETE FROM decisions WHERE step_id = ?1"
        f" AND task_id IN (SELECT value ->> 0 FROM {d.json_rows('?2')})"
    )
)
"""The clear of every task of ?2 (`_MOVE_GROUP`'s rows) at step ?1."""

_CLEAR_GROUP_PG = _CLEAR_GROUP.postgres + " RETURNING task_id"
"""`_CLEAR_GROUP` answering each deleted decision's task: PostgreSQL's count of what each clear deleted."""

_ENTRIES_ROWS = (
    "INSERT INTO step_entries (task_id, step_id, entry_seq, workflow_id, declaration_digest, entry_path,"
    " terminal, created_at, done_markers) SELECT e.value ->> 0, ?1, e.value ->> 1, ?2,"
    f" {digests.id_sql('?3')}, ?4, 1, CAST(e.value ->> 2 AS REAL), ?6"
    " FROM json_each(?5) AS e ORDER BY e.key"
)
"""`_ENTRIES_GROUP_PG` on SQLite, its seqs read first (`_SEQS_GROUP`): one terminal entry per row of ?5
([[task id, seq, now, key prefix], ...]). It reads no step_entries: SQLite runs an insert that selects
from its own table through a temporary table (it must not see its own rows), twice the instructions."""

_SEQS_GROUP = (
    "SELECT json_group_array(json_array(m.key, (SELECT COALESCE(MAX(entry_seq), 0) + 1 FROM step_entries"
    " WHERE task_id = m.value ->> 0 AND step_id = ?1), CASE WHEN ?2 THEN (SELECT count(*) FROM decisions"
    " WHERE task_id = m.value ->> 0 AND step_id = ?1) ELSE 0 END)), (SELECT COALESCE(MAX(id), 0) FROM runs)"
    " FROM json_each(?3) AS m"
)
"""One row, read before the group's entries are inserted: per task of ?3 its new entry's seq and how many
decisions the clear will delete, and the largest run id so far (every run the group queues has a larger
one: AUTOINCREMENT, one writer)."""

_RUNS_GROUP = Sql.of(
    lambda d: (
        "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, payload, key_position,"
        " key_digest, exclude_from_coalescing, requested_at, trigger, entry_seq, admission_seq)"
        " WITH e (i, task, prefix, now, seq) AS MATERIALIZED"
        f" (SELECT key, value ->> 0, value ->> 3, value ->> 2, value ->> 1 FROM {d.json_rows('?1')}),"
        " a (n, role, head, tail, reason, payload, position, digest) AS MATERIALIZED"
        " (SELECT key, value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4, value ->> 5,"
        f" value ->> 6 FROM {d.json_rows('?4')}),"
        " s (i, task, now, seq, n, agent, reason, payload, k, position, id, key_position, digest) AS"
        " (SELECT e.i, e.task, e.now, e.seq, a.n, p.agent_profile_id, a.reason, a.payload,"
        f" e.prefix || {keys.suffix_around_sql('a.head', 'p.agent_profile_id', 'a.tail')}, p.position, p.id,"
        " a.position, a.digest"
        f" FROM e CROSS JOIN a {d.join} {seats_sql(workflow='?3', step='?2', task='e.task', role='a.role')})"
        " SELECT CASE WHEN s.agent = '' OR EXISTS (SELECT 1 FROM coalesced_keys AS c"
        " WHERE c.idempotency_key = s.k) OR EXISTS (SELECT 1 FROM runs AS o WHERE o.idempotency_key = s.k)"
        " THEN NULL ELSE s.agent END, s.task, ?2, s.reason, s.payload, CAST(s.key_position AS INTEGER),"
        f" {digests.id_sql('s.digest')}, 1, CAST(s.now AS DOUBLE PRECISION),"
        " CASE s.reason WHEN 'on_enter' THEN '' ELSE 'on_enter' END, CAST(s.seq AS INTEGER),"
        " (SELECT admissions FROM tasks WHERE id = s.task) FROM s ORDER BY s.i, s.n, s.position, s.id"
    )
)
"""`_RUNS` for every entry of ?1 ([[task id, seq, now, key prefix], ...]) in entry order: the run ids are
those the entries get one after another. On SQLite its rows are read back by id (`_QUEUED_GROUP`), not
RETURNING: one row to fetch instead of one per run; PostgreSQL answers them (`_RUNS_GROUP_PG`)."""

_RUNS_GROUP_PG = _RUNS_GROUP.postgres + f" RETURNING id, task_id, agent_profile_id, {keys.STORED_KEY_SQL}"

_QUEUED_GROUP = (
    f"SELECT json_group_array(json_array(id, task_id, agent_profile_id, {keys.STORED_KEY_SQL}))"
    " FROM runs WHERE id > ?"
)


def _member(admission: Admitting) -> list[Any]:
    """`_MOVE_GROUP`'s row for one admission (no version: its workflow id null, nothing more verified)."""
    task, version = admission.task, admission.version
    verified = (version[0], int(version[1]), version[2]) if version else (None, 0, 0)
    return [task.id, task.step_id, *verified, admission.now]


def _admit_group(
    conn: Connection, plan: Plan, workflow_id: str, path: EntryPath, admissions: Sequence[Admitting]
) -> list[Admitted]:
    step = plan.step
    if step.wip_limit > 0:
        raise Anomaly("a WIP limit: admitted one at a time")
    if len({admission.task.id for admission in admissions}) != len(admissions):
        raise Anomaly("a task twice")
    members = json.dumps([_member(admission) for admission in admissions])
    if on_postgres(conn):
        return _admit_group_pg(conn, plan, workflow_id, path, admissions, members)
    if plan.fan_outs and flow.rates_set(conn):
        raise Anomaly("an hourly rate to check per run")
    if conn.execute(_MOVE_GROUP.sqlite, (workflow_id, step.id, members)).rowcount != len(admissions):
        raise Anomaly("a task moved")
    leaving = runs.leave_entries(conn, [admission.task.id for admission in admissions], admissions[0].now)
    digests.keep_rows(conn, plan.digests)
    seqs_json, last_run = conn.execute(_SEQS_GROUP, (step.id, plan.clears, members)).fetchone()
    entries = _numbered(plan, workflow_id, path, admissions, sorted(json.loads(seqs_json)))
    rows = json.dumps([entry[:4] for entry in entries])
    conn.execute(_ENTRIES_ROWS, (step.id, workflow_id, plan.declaration, path, rows, plan.done))
    history.record_transitions(conn, [transition for *_, transition in entries])
    if plan.clears:
        conn.execute(_CLEAR_GROUP.sqlite, (step.id, members))
    returned = []
    if plan.fan_outs:
        conn.execute(_RUNS_GROUP.sqlite, (rows, step.id, workflow_id, plan.fan_outs))
        returned = json.loads(conn.execute(_QUEUED_GROUP, (last_run,)).fetchone()[0])
    return _admitted(step.id, plan, entries, returned, leaving)


def _admit_group_pg(
    conn: Connection,
    plan: Plan,
    workflow_id: str,
    path: EntryPath,
    admissions: Sequence[Admitting],
    members: str,
) -> list[Admitted]:
    """`_admit_group` on PostgreSQL in two round trips before the commit: the rate check, the move, the
    leave, the entries (answering their seqs) and the clear are sent before any answer is read, then the
    last one's answer is read, which brings every earlier one's (a task that had moved, or an hourly rate
    set, fails the group then, and its savepoint undoes all of it); the history's transitions, the markers
    and the runs (answering what they queued) follow, and the runs' answer is the second wait."""
    step = plan.step
    rates = conn.execute(flow.RATES_SET) if plan.fan_outs else None
    moved = conn.execute(_MOVE_GROUP.postgres, (workflow_id, step.id, members))
    leaving = runs.leave_entries(conn, [admission.task.id for admission in admissions], admissions[0].now)
    digests.keep_rows(conn, plan.digests)
    seqs = conn.execute(_ENTRIES_GROUP_PG, (step.id, workflow_id, plan.declaration, path, members, plan.done))
    cleared = conn.execute(_CLEAR_GROUP_PG, (step.id, members)) if plan.clears else None
    # the last statement sent is read first: its answer brings every earlier one's (one wait)
    deleted = Counter(task_id for (task_id,) in (cleared.fetchall() if cleared is not None else ()))
    seq_of = dict(seqs.fetchall())
    if rates is not None and rates.fetchone() is not None:
        raise Anomaly("an hourly rate to check per run")
    if moved.rowcount != len(admissions):
        raise Anomaly("a task moved")
    numbered = [
        (index, seq_of[admission.task.id], deleted[admission.task.id])
        for index, admission in enumerate(admissions)
    ]
    entries = _numbered(plan, workflow_id, path, admissions, numbered)
    history.record_transitions(conn, [transition for *_, transition in entries])
    rows = json.dumps([entry[:4] for entry in entries])
    returned = []
    if plan.fan_outs:
        returned = conn.execute(_RUNS_GROUP_PG, (rows, step.id, workflow_id, plan.fan_outs)).fetchall()
    return _admitted(step.id, plan, entries, returned, leaving)


_Numbered = tuple[str, int, float, str, int, tuple[str, float, str]]
"""An entry of a group: task id, seq, now, key prefix, decisions its clear deleted, its transition."""


def _numbered(
    plan: Plan,
    workflow_id: str,
    path: EntryPath,
    admissions: Sequence[Admitting],
    numbered: Sequence[tuple[int, int, int]],
) -> list[_Numbered]:
    """The group's entries from (admission index, seq, decisions deleted), in that order."""
    step_id = plan.step.id
    entries: list[_Numbered] = []
    for index, seq, count in numbered:
        admission = admissions[index]
        task_id = admission.task.id
        cause = (admission.trigger, admission.operation_id)
        detail = _transition(admission.task, workflow_id, plan, path, seq, cause)
        prefix = keys.entry_prefix(task_id, step_id, seq)
        entries.append((task_id, seq, admission.now, prefix, count, (task_id, admission.now, detail)))
    return entries


def _admitted(
    step_id: str,
    plan: Plan,
    entries: list[_Numbered],
    returned: Sequence[Any],
    leaving: runs.Leaving,
) -> list[Admitted]:
    """Each entry's `Admitted`: what its actions did, from the runs queued (`returned`: (run id, task id,
    agent, key) rows) and the runs its task's leaving changed."""
    queued: dict[str, dict[int, list[tuple[str, int, str]]]] = {}
    prefixes = {entry[0]: entry[3] for entry in entries}
    for run_id, task_id, agent, run in sorted(returned):
        position = keys.position_in(run, prefixes[task_id])
        queued.setdefault(task_id, {}).setdefault(position, []).append((agent, run_id, run))
    left: dict[str | None, list[Change]] = {}
    for change in leaving.changes():  # read last: its answer came with the later statements'
        left.setdefault(change.task_id, []).append(change)
    return [
        Admitted(
            EntryKey(task_id, step_id, seq),
            _done(plan, deleted, queued.get(task_id, {})),
            tuple(left.get(task_id, ())),
        )
        for task_id, seq, _, _, deleted, _ in entries
    ]


def _done(plan: Plan, deleted: int, queued: dict[int, list[tuple[str, int, str]]]) -> Done:
    """Per position in dispatch order what an entry did: its clear the `deleted` count (a second clear in the
    same entry finds nothing left), its fan-out the runs `queued` at that position."""
    done: list[tuple[int, int | Queued]] = []
    for position, action in plan.order:
        if action.type == "clear_decisions":
            done.append((position, deleted))
            deleted = 0
        else:
            done.append((position, tuple(queued.get(position, ()))))
    return tuple(done)
