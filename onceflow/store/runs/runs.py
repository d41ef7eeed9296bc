"""The runs queue: idempotent, coalescing enqueue; where a run comes from; cancelling the runs of a step
entry its task left. Writer thread: every function runs inside the caller's transaction. A run's claims,
leases and retries are store/runs/run_claims.py's.

Rules (kandev-engine-notes.md, "Runs queue"; on-enter-action-dispatch.md AC-B4, AC-H6, AC-H9):
- every idempotency key is kept with the run it produced (`runs.idempotency_key`, an on_enter key by its
  parts: store/runs/keys.py `stored_columns`) or, for an enqueue merged
  by coalescing, in `coalesced_keys` with the run it was merged into; while that run is unresolved, and for
  24 h after it resolves, the key makes an enqueue a success that changes nothing;
- within 5 s, the newest queued run of the same task with the same (agent_profile_id, reason) absorbs the
  enqueue (count + 1, payload replaced) — never a run of another task, and not when either side has
  `exclude_from_coalescing` set. That flag is a discrete column read by both `should_coalesce` and the
  coalescing SQL, never encoded in the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from onceflow.protocol.results import RunInfo
from onceflow.protocol.times import rfc3339, rfc3339_or_none
from onceflow.store.backends.clock import SERVER_CLOCK, Clocked
from onceflow.store.backends.connection import Connection, Cursor
from onceflow.store.backends.dialect import POSTGRES, SQLITE
from onceflow.store.backends.savepoint import savepoint
from onceflow.store.backends.urls import on_postgres
from onceflow.store.records import RunRecord
from onceflow.store.runs import digests, keys
from onceflow.store.runs.flow import Cause, Lineage, Refusal, lineage, refusal

IDEMPOTENCY_WINDOW_SECONDS = 24 * 60 * 60
COALESCE_WINDOW_SECONDS = 5.0

TRIGGER = "CASE trigger WHEN '' THEN reason ELSE trigger END"
"""A run's trigger as read: `trigger` holds '' where it is the run's reason (on_enter runs mostly: a trigger
is never '' itself, it names one), so the common case stores no copy of the name (migration 23)."""

COLUMNS = (
    f"id, agent_profile_id, task_id, workflow_step_id, reason, payload, {keys.STORED_KEY_SQL},"
    f" exclude_from_coalescing, status, coalesced_count, requested_at, {TRIGGER}, entry_seq, admission_seq,"
    " attempt, retries, claim_token, lease_expires_at, retry_at, superseded, outcome_reason, last_error,"
    " finished_at, priority, parent_run_id, causation_depth, COALESCE(chain_id, id), human_rooted, retry_of,"
    " result, rate_limit"
)
"""Every column a `RunRecord` is read from, in `run_from_row` order."""

UNRESOLVED = ("queued", "claimed")
"""The statuses of a run still to be done: its key is honoured whatever its age."""


@attrs.frozen
class RunRequest:
    """What to enqueue. `payload` None is stored as SQL NULL (on-enter spec AC-H2), never as `{}`.

    Where it comes from: `trigger` (the firing trigger), `entry_seq` (an on_enter run's step entry) and
    `admission_seq` (the admission counter of the run's task when queued: the step entry of that task the
    run belongs to, so leaving it cancels the run; None for a run queued for another task).

    Flow control (store/runs/flow.py): `priority` 0 human, 1 recovery, 2 event (the default), 3 periodic;
    `cause` places it in a causation chain and may get it refused; `retry_of` the run it retries."""

    agent_profile_id: str
    task_id: str | None
    step_id: str | None
    reason: str
    payload: dict[str, Any] | None = None
    idempotency_key: str | None = None
    exclude_from_coalescing: bool = False
    trigger: str | None = None
    entry_seq: int | None = None
    admission_seq: int | None = None
    priority: int = 2
    cause: Cause | None = None
    retry_of: int | None = None


@attrs.frozen
class EnqueueResult:
    """`queued` inserted run_id; `suppressed` found run_id under the same key (`deduped` on the wire);
    `coalesced` merged into it; `rate_limited` refused by `refusal` (run_id: the refused run, kept cancelled
    and key-less, so the key stays free)."""

    outcome: Literal["queued", "suppressed", "coalesced", "rate_limited"]
    run_id: int
    coalesced_count: int = 0
    refusal: Refusal | None = None
    lineage: Lineage = attrs.field(factory=Lineage)


def run_from_row(row: tuple[Any, ...]) -> RunRecord:
    """A `RunRecord` from a row selected as `COLUMNS`."""
    return RunRecord(
        id=row[0],
        agent_profile_id=row[1],
        task_id=row[2],
        step_id=row[3],
        reason=row[4],
        payload=json.loads(row[5]) if row[5] is not None else None,
        idempotency_key=row[6],
        exclude_from_coalescing=bool(row[7]),
        status=row[8],
        coalesced_count=row[9],
        requested_at=row[10],
        trigger=row[11],
        entry_seq=row[12],
        admission_seq=row[13],
        attempt=row[14],
        retries=row[15],
        claim_token=row[16],
        lease_expires_at=row[17],
        retry_at=row[18],
        superseded=bool(row[19]),
        outcome_reason=row[20],
        last_error=row[21],
        finished_at=row[22],
        priority=row[23],
        parent_run_id=row[24],
        causation_depth=row[25],
        chain_id=row[26],
        human_rooted=bool(row[27]),
        retry_of=row[28],
        result=json.loads(row[29]) if row[29] is not None else None,
        rate_limit=row[30],
    )


def payload_json(payload: dict[str, Any] | None) -> str | None:
    """The stored form of a run payload: canonical JSON (sorted keys), None stays SQL NULL (AC-H2)."""
    return None if payload is None else json.dumps(payload, sort_keys=True, separators=(",", ":"))


def should_coalesce(request: RunRequest) -> bool:
    """Whether this request may be merged into an earlier queued run (AC-H9's predicate)."""
    return not request.exclude_from_coalescing


def key_honoured(*, status: str, seen_at: float, finished_at: float | None, now: float) -> bool:
    """Whether an idempotency key still suppresses an enqueue: while the run it produced is unresolved
    (queued or claimed), and for 24 h after that run resolved (or after the key was seen, if later).

    A stricter reading of AC-H6 that never produces more runs than "24 h after the key was seen": a run left
    queued or claimed for 25 h keeps its key. All times are Unix seconds.
    """
    if status in UNRESOLVED:
        return True
    return (
        now - max(seen_at, finished_at if finished_at is not None else seen_at) < IDEMPOTENCY_WINDOW_SECONDS
    )


_MERGED = Clocked.of(
    "SELECT k.run_id, k.seen_at, r.status, r.finished_at, {now} FROM coalesced_keys k"
    " JOIN runs r ON r.id = k.run_id WHERE k.idempotency_key = ?1",
    "?2",
)
_OWN = Clocked.of(
    "SELECT id, requested_at, status, finished_at, {now} FROM runs WHERE idempotency_key = ?1", "?2"
)
_OWN_BY_PARTS = Clocked.of(
    "SELECT id, requested_at, status, finished_at, {now} FROM runs WHERE task_id = ?1 AND"
    " workflow_step_id = ?2 AND entry_seq = ?3 AND key_position = ?4 AND agent_profile_id = ?5",
    "?6",
)
_KEEP_KEY = Clocked.of(
    "INSERT INTO coalesced_keys (idempotency_key, run_id, seen_at) VALUES (?1, ?2, {now})", "?3"
)


def enqueue_run(conn: Connection, request: RunRequest, now: float) -> EnqueueResult:
    """Enqueue inside the caller's transaction. `now` is Unix seconds (the runtime's clock; on PostgreSQL
    the key windows, the coalescing window and the stamps read the server's clock, store/backends/clock.py).

    A key still honoured (`key_honoured`) makes the enqueue a success that changes nothing (`suppressed`,
    naming the run the key produced or was merged into). Otherwise the request coalesces into the newest
    queued run of the same task, agent and reason from the last 5 s (never across tasks), recording its key in
    `coalesced_keys`, or is inserted under its key. A key lives in one place: the run it was inserted with, or
    `coalesced_keys`; re-applying an expired key moves it.

    Atomic: an enqueue that raises leaves none of its writes behind (one write, or several in a savepoint),
    so a fan-out needs no savepoint of its own per participant.
    """
    key = request.idempotency_key or None
    if key is None:
        return _coalesce(conn, request, now) or _queue(conn, request, now)
    merged = conn.execute(_MERGED.on(conn), (key, now)).fetchone()
    if merged is not None and key_honoured(
        status=merged[2], seen_at=merged[1], finished_at=merged[3], now=merged[4]
    ):
        return EnqueueResult("suppressed", merged[0])
    entry = keys.entry_parts(key)
    own = None
    if merged is None and not should_coalesce(request):  # the common keyed case: insert, look on a conflict
        if entry is not None:  # an on_enter key: held maybe in the form this insert does not conflict on
            own = _own(conn, key, entry, now)
        if own is None:
            inserted = _insert(conn, request, now, skip_taken_key=True)
            if inserted is not None:
                return inserted
    if own is None:
        own = _own(conn, key, entry, now)
    if own is not None and key_honoured(status=own[2], seen_at=own[1], finished_at=own[3], now=own[4]):
        return EnqueueResult("suppressed", own[0])
    with savepoint(conn, "enqueue"):  # release the expired key, then merge or insert under it: all or none
        if merged is not None:
            conn.execute("DELETE FROM coalesced_keys WHERE idempotency_key = ?", (key,))
        if own is not None:
            conn.execute(
                "UPDATE runs SET idempotency_key = NULL, key_position = NULL, key_digest = NULL WHERE id = ?",
                (own[0],),
            )
        result = _coalesce(conn, request, now)
        if result is None:
            return _queue(conn, request, now)
        conn.execute(_KEEP_KEY.on(conn), (key, result.run_id, now))
    return result


_COALESCE_ON = (
    "SELECT id, coalesced_count FROM runs WHERE agent_profile_id = ?1 AND reason = ?2 AND task_id {same} ?3"
    " AND status = 'queued' AND exclude_from_coalescing = 0 AND requested_at >= {now} - ?5"
    " ORDER BY requested_at DESC, id DESC LIMIT 1"
)
_COALESCE = Clocked(
    _COALESCE_ON.format(same=SQLITE.same, now="?4"), _COALESCE_ON.format(same=POSTGRES.same, now=SERVER_CLOCK)
)


def _coalesce(conn: Connection, request: RunRequest, now: float) -> EnqueueResult | None:
    """Merge into the newest coalescible queued run of the same task, agent and reason, or None."""
    if not should_coalesce(request):
        return None
    row = conn.execute(
        _COALESCE.on(conn),
        (request.agent_profile_id, request.reason, request.task_id, now, COALESCE_WINDOW_SECONDS),
    ).fetchone()
    if row is None:
        return None
    conn.execute(
        "UPDATE runs SET coalesced_count = coalesced_count + 1, payload = ? WHERE id = ?",
        (payload_json(request.payload), row[0]),
    )
    return EnqueueResult("coalesced", row[0], row[1] + 1)


def _queue(conn: Connection, request: RunRequest, now: float) -> EnqueueResult:
    queued = _insert(conn, request, now)
    assert queued is not None  # without skip_taken_key a conflict raises
    return queued


def _own(conn: Connection, key: str, entry: keys.EntryRunKey | None, now: float) -> Any:
    """(id, requested_at, status, finished_at, now) of the run holding `key`, as its text or (an on_enter
    key, `entry`) by its parts; None: no run holds it."""
    own = conn.execute(_OWN.on(conn), (key, now)).fetchone()
    if own is None and entry is not None:
        at = (entry.task_id, entry.step_id, entry.entry_seq, entry.position, entry.agent_profile_id, now)
        own = conn.execute(_OWN_BY_PARTS.on(conn), at).fetchone()
    return own


def _parts(request: RunRequest) -> tuple[int, str] | None:
    """The request's key stored by its parts (`keys.stored_columns`), or None: stored as its text."""
    if request.idempotency_key is None:
        return None
    return keys.stored_columns(
        request.idempotency_key,
        request.task_id,
        request.step_id,
        request.entry_seq,
        request.agent_profile_id,
    )


_INSERT = Clocked.of(
    "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, payload, idempotency_key,"
    " exclude_from_coalescing, requested_at, trigger, entry_seq, admission_seq, priority, parent_run_id,"
    " causation_depth, chain_id, human_rooted, self_trigger, retry_of, status, outcome_reason, finished_at,"
    " rate_limit, key_position, key_digest)"
    " VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, {now}, CASE WHEN ?9 = ?4 THEN '' ELSE ?9 END, ?10, ?11, ?12,"
    " ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20,"
    " CASE WHEN ?19 = 'cancelled' THEN {now} END, ?21, ?22,"
    " (SELECT dg.id FROM digests AS dg WHERE dg.digest = ?23))",
    "?8",
)
_INSERT = Clocked(_INSERT.sqlite + " RETURNING id", _INSERT.postgres + " RETURNING id")
_INSERT_NEW = Clocked(
    _INSERT.sqlite.replace(
        " RETURNING id",
        " ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING id",
    ),
    _INSERT.postgres.replace(
        " RETURNING id",
        " ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING id",
    ),
)
_INSERT_NEW_BY_PARTS = Clocked(
    _INSERT.sqlite.replace(
        " RETURNING id", f" ON CONFLICT ({keys.ENTRY_KEY_COLUMNS}) DO NOTHING RETURNING id"
    ),
    _INSERT.postgres.replace(
        " RETURNING id", f" ON CONFLICT ({keys.ENTRY_KEY_COLUMNS}) DO NOTHING RETURNING id"
    ),
)


def _insert(
    conn: Connection, request: RunRequest, now: float, *, skip_taken_key: bool = False
) -> EnqueueResult | None:
    """Insert the run as queued, unless the flow gate refuses it (store/runs/flow.py `refusal`): then it is
    kept cancelled `rate_limited`, naming the limit, without its key (a refusal never consumes a key).
    `skip_taken_key`: a key already on a run inserts nothing, returns None (and so does a refusal, which the
    caller then retries without it once it has checked the key)."""
    line: Lineage = lineage(conn, request.agent_profile_id, request.cause)
    refused = refusal(conn, request.agent_profile_id, request.reason, line, request.cause, now)
    if refused is not None and skip_taken_key:
        return None
    parts = _parts(request) if refused is None else None
    statement = (_INSERT_NEW_BY_PARTS if parts else _INSERT_NEW) if skip_taken_key else _INSERT
    if parts:
        digests.keep(conn, (parts[1],))
    cur = conn.execute(
        statement.on(conn),
        (
            request.agent_profile_id,
            request.task_id,
            request.step_id,
            request.reason,
            payload_json(request.payload),
            request.idempotency_key or None if refused is None and parts is None else None,
            int(request.exclude_from_coalescing),
            now,
            request.trigger,
            request.entry_seq,
            request.admission_seq,
            request.priority,
            line.parent_run_id,
            line.depth,
            line.chain_id,
            int(line.human_rooted),
            int(line.self_trigger),
            request.retry_of,
            "queued" if refused is None else "cancelled",
            None if refused is None else "rate_limited",
            None if refused is None else refused.limit,
            None if parts is None else parts[0],
            None if parts is None else parts[1],
        ),
    )
    row = cur.fetchone()
    if row is None:
        return None
    run_id = int(row[0])
    if refused is not None:
        return EnqueueResult("rate_limited", run_id, refusal=refused, lineage=line)
    return EnqueueResult("queued", run_id, lineage=line)


def list_runs(
    conn: Connection,
    *,
    task_id: str | None = None,
    agent_profile_id: str | None = None,
    status: str | None = None,
) -> list[RunRecord]:
    """Runs matching every given filter, oldest first."""
    clauses, args = [], []
    for column, value in (("task_id", task_id), ("agent_profile_id", agent_profile_id), ("status", status)):
        if value is not None:
            clauses.append(f"{column} = ?")
            args.append(value)
    where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
    rows = conn.execute(f"SELECT {COLUMNS} FROM runs{where} ORDER BY requested_at, id", args).fetchall()
    return [run_from_row(row) for row in rows]


def runs_page(
    conn: Connection,
    *,
    after_id: int | None,
    limit: int,
    task_id: str | None = None,
    agent_profile_id: str | None = None,
    status: str | None = None,
) -> tuple[list[RunInfo], bool]:
    """Up to `limit` runs matching every given filter with ids after `after_id` (None: from the first), in
    id order (oldest first), as replies show them (`run_info`), and whether more follow (a page of
    `list_runs`; keyed by id, so a page costs the same however deep it is). Each is built from its row
    (`info_from_row`): no `RunRecord` per run on the way."""
    clauses, args = ["id > ?"], list[object]([after_id if after_id is not None else -1])
    for column, value in (("task_id", task_id), ("agent_profile_id", agent_profile_id), ("status", status)):
        if value is not None:
            clauses.append(f"{column} = ?")
            args.append(value)
    rows = conn.execute(
        f"SELECT {COLUMNS} FROM runs WHERE {' AND '.join(clauses)} ORDER BY id LIMIT ?", [*args, limit + 1]
    ).fetchall()
    return [info_from_row(row) for row in rows[:limit]], len(rows) > limit


def get_run(conn: Connection, run_id: int) -> RunRecord | None:
    """The run `run_id`, or None when there is none."""
    row = conn.execute(f"SELECT {COLUMNS} FROM runs WHERE id = ?", (run_id,)).fetchone()
    return None if row is None else run_from_row(row)


@attrs.frozen
class Change:
    """A run a statement changed, for the event the Trio side emits once it commits: `kind` is cancelled,
    superseded (a claimed run whose entry was left: it stays claimed), lease_expired, claimed, finished,
    retry_scheduled (with `retry_at`, `retries`, `error`), failed (with `error`), claimed (with
    `lease_expires_at`), finished (with `superseded`), or escalated (the
    `agent_error` run queued for a CEO agent when a run failed: `reason` is its enqueue's outcome, `step_id`
    its step; a `rate_limited` one names the limit in `error` and its value in `retries`); `reason` says
    why."""

    kind: str
    run_id: int
    task_id: str | None
    agent_profile_id: str
    attempt: int
    reason: str = ""
    step_id: str | None = None
    error: str | None = None
    retry_at: float | None = None
    retries: int = 0
    lease_expires_at: float | None = None
    superseded: bool = False


_LEAVE = (
    "UPDATE runs SET status = CASE status WHEN 'queued' THEN 'cancelled' ELSE status END,"
    " outcome_reason = CASE status WHEN 'queued' THEN ?3 ELSE outcome_reason END,"
    " finished_at = CASE status WHEN 'queued' THEN {now} ELSE finished_at END, superseded = 1"
    " WHERE {tasks} AND status IN ('queued', 'claimed') AND admission_seq IS NOT NULL AND superseded = 0"
    " RETURNING id, status, agent_profile_id, attempt, task_id"
)
_LEAVE_ONE = Clocked.of(_LEAVE.format(tasks="task_id = ?1", now="{now}"), "?2")
_LEAVE_MANY = _LEAVE.format(tasks=f"task_id IN (SELECT value FROM {SQLITE.json_rows('?1')})", now="?2")
_LEAVE_MANY_PG = Clocked.of(  # ANY: a planner estimate a json set would not give
    _LEAVE.format(tasks="task_id = ANY(?1)", now="{now}"), "?2"
).postgres


@attrs.frozen
class Leaving:
    """`leave_entries`' statement, sent: its answer is read by `changes`, as late as the caller can (on
    PostgreSQL, a pipelined answer read after a later statement's costs no round trip of its own; on SQLite
    the rows are read at once, since a statement left unread blocks the next savepoint)."""

    rows: Cursor | list[Any]
    reason: str

    def changes(self) -> tuple[Change, ...]:
        """The runs it cancelled (queued ones) and superseded (claimed ones)."""
        rows = self.rows if isinstance(self.rows, list) else self.rows.fetchall()
        return tuple(
            Change(
                "cancelled" if status == "cancelled" else "superseded",
                run_id,
                task_id,
                agent,
                attempt,
                self.reason,
            )
            for run_id, status, agent, attempt, task_id in rows
        )


def leave_entries(
    conn: Connection, task_ids: Sequence[str], now: float, reason: str = "entry_left"
) -> Leaving:
    """The tasks are leaving the step entries they are in (a step change, a WIP queue, a workflow switch):
    their queued runs that belong to an entry of their own are cancelled (`reason`), their claimed ones
    marked superseded (their holders are told; a finish still counts). Runs queued for them by another task
    (no admission) are left alone. Call it after the compare-and-set step change and before the new entry
    queues its own runs; read `Leaving.changes` once the transaction's later reads are done. One statement
    for all of them, over the open runs only (`runs_open_by_task`)."""
    if on_postgres(conn):
        if len(task_ids) == 1:
            return Leaving(conn.execute(_LEAVE_ONE.postgres, (task_ids[0], now, reason)), reason)
        return Leaving(conn.execute(_LEAVE_MANY_PG, (list(task_ids), now, reason)), reason)
    if len(task_ids) == 1:
        return Leaving(conn.execute(_LEAVE_ONE.sqlite, (task_ids[0], now, reason)).fetchall(), reason)
    return Leaving(conn.execute(_LEAVE_MANY, (json.dumps(list(task_ids)), now, reason)).fetchall(), reason)


def run_info(run: RunRecord) -> RunInfo:
    """The run as replies show it, times as RFC 3339 (a dict display: calling a typed dict class costs a
    dict(**kwargs))."""
    return {
        "id": run.id,
        "agent_profile_id": run.agent_profile_id,
        "task_id": run.task_id,
        "step_id": run.step_id,
        "reason": run.reason,
        "payload": run.payload,
        "idempotency_key": run.idempotency_key,
        "exclude_from_coalescing": run.exclude_from_coalescing,
        "status": run.status,
        "coalesced_count": run.coalesced_count,
        "requested_at": rfc3339(run.requested_at),
        "trigger": run.trigger,
        "entry_seq": run.entry_seq,
        "admission_seq": run.admission_seq,
        "attempt": run.attempt,
        "retries": run.retries,
        "lease_expires_at": rfc3339_or_none(run.lease_expires_at) if run.status == "claimed" else None,
        "retry_at": rfc3339_or_none(run.retry_at) if run.status == "queued" else None,
        "superseded": run.superseded,
        "outcome_reason": run.outcome_reason,
        "last_error": run.last_error,
        "priority": run.priority,
        "parent_run_id": run.parent_run_id,
        "causation_depth": run.causation_depth,
        "chain_id": run.chain_id if run.chain_id is not None else run.id,
        "human_rooted": run.human_rooted,
        "retry_of": run.retry_of,
        "result": run.result,
        "enqueue_outcome": "rate_limited" if run.rate_limit is not None else "queued",
        "rate_limit": run.rate_limit,
    }


_last_requested: tuple[float, str] = (math.nan, "")
"""The `requested_at` `info_from_row` formatted last, and its text: a fan-out's runs, listed together, were
requested at the same instant. One tuple, swapped whole: safe from any thread."""


def info_from_row(row: tuple[Any, ...]) -> RunInfo:
    """`run_info(run_from_row(row))` for a row selected as `COLUMNS`, without the `RunRecord` in between
    (a page of `list_runs` builds one per run)."""
    global _last_requested
    status, rate_limit, requested = row[8], row[30], row[10]
    last = _last_requested
    if last[0] != requested:
        last = _last_requested = (requested, rfc3339(requested))
    return {
        "id": row[0],
        "agent_profile_id": row[1],
        "task_id": row[2],
        "step_id": row[3],
        "reason": row[4],
        "payload": json.loads(row[5]) if row[5] is not None else None,
        "idempotency_key": row[6],
        "exclude_from_coalescing": bool(row[7]),
        "status": status,
        "coalesced_count": row[9],
        "requested_at": last[1],
        "trigger": row[11],
        "entry_seq": row[12],
        "admission_seq": row[13],
        "attempt": row[14],
        "retries": row[15],
        "lease_expires_at": rfc3339_or_none(row[17]) if status == "claimed" else None,
        "retry_at": rfc3339_or_none(row[18]) if status == "queued" else None,
        "superseded": bool(row[19]),
        "outcome_reason": row[20],
        "last_error": row[21],
        "priority": row[23],
        "parent_run_id": row[24],
        "causation_depth": row[25],
        "chain_id": row[26] if row[26] is not None else row[0],
        "human_rooted": bool(row[27]),
        "retry_of": row[28],
        "result": json.loads(row[29]) if row[29] is not None else None,
        "enqueue_outcome": "rate_limited" if rate_limit is not None else "queued",
        "rate_limit": rate_limit,
    }
