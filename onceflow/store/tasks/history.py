"""A task's history: the durable timeline of how it got where it is. Writer thread (and the read-only views'
own connection): every function runs inside the caller's transaction.

Only what no other table keeps is written, in the transaction of the effect itself, to `task_history`
(task id, per-task `seq`, `at`, `kind`, `detail` JSON): the task's creation (`created`), each transition
(`transition`: from and to step, trigger, operation id, entry path and the step entry it allocated: the
step change overwrites the task row and a step that declares no engine-owned action allocates no entry
record, so neither keeps it), each decision recorded (`decision`: `clear_decisions` deletes decision
rows) and each migration onto another version of its workflow (`migrated`, store/tasks/task_migration.py). One
row per admission, one statement (an `executemany` on SQLite) per writer group of common entries
(store/entries/common_entry.py) or of creations (store/tasks/tasks.py `create_tasks`).

Runs are not written twice: their queue row keeps when each was queued, claimed (the latest claim: a run
retried shows its last attempt) and resolved, and `page` derives their items from it (`run` items, status
`queued`, `claimed`, or its final status). Nor are host calls answered over `onceflow serve`'s host role:
their rows (store/outcomes/host_calls.py) give `host_call` items, at the time each ended.

`page` merges them in one query, ordered by (time, rank, key): a transition before the runs it queued at
the same instant, those before a claim, a claim before an end, an end before a host call; `after` is the
last item's cursor. Times are the runtime clock's (Unix seconds in the database, RFC 3339 UTC in the
items). Retention (store/retention/retention.py) deletes history rows past the retention like the runs they
sit beside.
"""

from __future__ import annotations

import functools
import json
import math
from json.encoder import encode_basestring_ascii
from typing import Any, Literal, cast

import attrs

from onceflow.protocol.errors import NotFoundError, ProtocolError
from onceflow.protocol.results import HistoryItem, HistoryPage, HostCallInfo
from onceflow.protocol.times import rfc3339
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.dialect import POSTGRES
from onceflow.store.backends.urls import on_postgres
from onceflow.store.outcomes import host_calls
from onceflow.store.runs import runs

Kind = Literal["created", "transition", "decision", "run", "host_call", "migrated"]

_COMPACT = json.JSONEncoder(separators=(",", ":"))
"""`json.dumps(..., separators=(",", ":"))` without a new encoder per call (one per entry)."""

_string = encode_basestring_ascii
"""A str as a JSON string, as `_COMPACT` writes it (ASCII, its own escapes)."""

_INSERT = (
    "INSERT INTO task_history (task_id, seq, at, kind, detail) VALUES"
    " (?1, (SELECT COALESCE(MAX(seq), 0) + 1 FROM task_history WHERE task_id = ?1), ?2, ?3, ?4)"
)
"""One item, numbered one past the task's last. VALUES with a subquery, not `INSERT ... SELECT` from the
table it inserts into, which SQLite runs through a temporary table (~40 % more instructions a row)."""


def hold(conn: Connection, task_id: str) -> None:
    """On PostgreSQL, lock the task's row until `conn`'s transaction ends, so two runtimes appending to one
    task's history never number two items alike (a transition holds it already: its step change updates
    the row first); nothing on SQLite, whose one writer serializes every transaction. Call it before the
    transaction's first statement that touches the task's rows."""
    if on_postgres(conn):
        conn.execute("UPDATE tasks SET updated_at = updated_at WHERE id = ?", (task_id,))


def record(conn: Connection, task_id: str, at: float, kind: str, detail: dict[str, Any]) -> None:
    """Append one item of `kind` to the task's history at `at` (Unix seconds), numbered one past its last.
    Raises sqlite3.Error (the task does not exist: its foreign key)."""
    conn.execute(_INSERT, (task_id, at, kind, _COMPACT.encode(detail)))


def record_detail(conn: Connection, task_id: str, at: float, kind: str, detail: str) -> None:
    """`record` of a detail already encoded as JSON."""
    conn.execute(_INSERT, (task_id, at, kind, detail))


def record_many(conn: Connection, items: list[tuple[str, float, str, str]]) -> None:
    """`record_detail` of each (task id, at, kind, detail JSON), one statement run for each (the tasks are
    distinct, or later items of a task are numbered after its earlier ones)."""
    conn.executemany(_INSERT, items)


@functools.lru_cache(maxsize=256)
def created_detail(workflow_id: str, workflow_version: int, step_id: str, queued: bool) -> str:
    """The `detail` JSON of a task's `created` item (the same for every task created into one step of one
    version: encoded once)."""
    detail = {
        "workflow_id": workflow_id,
        "workflow_version": workflow_version,
        "step_id": step_id,
        "queued": queued,
    }
    return _COMPACT.encode(detail)


def transition_detail(
    *,
    from_step: str | None,
    to_step: str,
    workflow_id: str,
    trigger: str,
    operation_id: str,
    path: str | None,
    entry_seq: int | None,
    queued: bool = False,
) -> str:
    """The `detail` JSON of a transition: `queued` when the task waits at a full step (not an entry),
    `entry_seq` None when the step allocates no entry record (or the task is queued). Stored without the
    fields at their defaults (`TRANSITION_DEFAULTS`: no operation id, not queued), which `transition_item`
    puts back: ~35 bytes fewer per row, the history's most frequent. The text is `_COMPACT`'s of the same
    dict, written out field by field (a third of the encoder's instructions: one per entry)."""
    text = (
        f'{{"from_step":{_text(from_step)},"to_step":{_string(to_step)},"workflow_id":{_string(workflow_id)},'
        f'"trigger":{_string(trigger)},"entry_path":{_text(path)},'
        f'"entry_seq":{"null" if entry_seq is None else int(entry_seq)}'
    )
    if operation_id:
        text += f',"operation_id":{_string(operation_id)}'
    return f'{text},"queued":true}}' if queued else f"{text}}}"


def _text(value: str | None) -> str:
    """A JSON string or null, as `_COMPACT` writes it."""
    return "null" if value is None else _string(value)


TRANSITION_DEFAULTS: dict[str, Any] = {"operation_id": None, "queued": False}
"""What a transition's stored detail leaves out: its value when absent."""

_TRANSITION_ORDER = (
    "from_step",
    "to_step",
    "workflow_id",
    "trigger",
    "operation_id",
    "entry_path",
    "entry_seq",
    "queued",
)


def transition_item(stored: dict[str, Any]) -> dict[str, Any]:
    """A transition's detail as `task_history` shows it: every field, in order, defaults put back (rows
    written before the defaults were left out spell them, and read the same)."""
    return {name: stored.get(name, TRANSITION_DEFAULTS.get(name)) for name in _TRANSITION_ORDER}


def record_transition(conn: Connection, task_id: str, at: float, detail: str) -> None:
    """Append a transition (`transition_detail`) to the task's history."""
    conn.execute(_INSERT_TRANSITION, (task_id, at, detail))


_INSERT_TRANSITION = (
    "INSERT INTO task_history (task_id, seq, at, kind, detail) VALUES"
    " (?1, (SELECT COALESCE(MAX(seq), 0) + 1 FROM task_history WHERE task_id = ?1), ?2, 'transition', ?3)"
)

_INSERT_TRANSITIONS_PG = (
    "INSERT INTO task_history (task_id, seq, at, kind, detail) SELECT m.value ->> 0,"
    " (SELECT COALESCE(MAX(seq), 0) + 1 FROM task_history WHERE task_id = m.value ->> 0),"
    " CAST(m.value ->> 1 AS DOUBLE PRECISION), 'transition', m.value ->> 2"
    f" FROM {POSTGRES.json_rows('?1', 'm')}"
)


def record_transitions(conn: Connection, rows: list[tuple[str, float, str]]) -> None:
    """Append one transition per (task id, at, detail JSON); the tasks are distinct. On SQLite one statement
    run per row (`executemany`: half the instructions of one statement over a JSON array, which SQLite
    reads through a temporary table); on PostgreSQL one statement, which needs no answer before the
    commit (an `executemany` would wait for its rows' answers)."""
    if on_postgres(conn):
        conn.execute(_INSERT_TRANSITIONS_PG, (json.dumps(rows),))
    else:
        conn.executemany(_INSERT_TRANSITION, rows)


@attrs.frozen
class Cursor:
    """A position in a task's history: the item's time (Unix seconds), rank and key (`page`)."""

    at: float
    rank: int
    key: int

    def encode(self) -> str:
        """The cursor as the wire carries it: `<at>:<rank>:<key>` (`at` exact, as Python's repr)."""
        return f"{self.at!r}:{self.rank}:{self.key}"


def parse_cursor(text: str) -> Cursor:
    """The cursor `Cursor.encode` wrote.

    Raises:
        ProtocolError: not one (field after).
    """
    parts = text.split(":")
    try:
        if len(parts) != 3:
            raise ValueError(text)
        cursor = Cursor(float(parts[0]), int(parts[1]), int(parts[2]))
    except ValueError:
        raise ProtocolError(f"after {text!r} is not a history cursor", field="after") from None
    if not math.isfinite(cursor.at):
        raise ProtocolError(f"after {text!r} is not a history cursor", field="after")
    return cursor


_RUN_COLUMNS = (
    f"id, agent_profile_id, workflow_step_id, attempt, {runs.TRIGGER}, entry_seq, reason, outcome_reason"
)
_UNION = (
    "SELECT requested_at AS at, 1 AS rank, id AS k, 'run' AS kind, 'queued' AS status, NULL AS detail,"
    f" {_RUN_COLUMNS} FROM runs WHERE task_id = ?1"
    f" UNION ALL SELECT claimed_at, 2, id, 'run', 'claimed', NULL, {_RUN_COLUMNS}"
    " FROM runs WHERE task_id = ?1 AND claimed_at IS NOT NULL"
    f" UNION ALL SELECT finished_at, 3, id, 'run', status, NULL, {_RUN_COLUMNS}"
    " FROM runs WHERE task_id = ?1 AND finished_at IS NOT NULL"
    " AND status IN ('finished', 'failed', 'cancelled')"
    " UNION ALL SELECT at, 0, seq, kind, NULL, detail, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL"
    " FROM task_history WHERE task_id = ?1"
    " UNION ALL SELECT answered_at, 4, id, 'host_call', status, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
    " NULL, NULL FROM host_calls WHERE task_id = ?1"
)
_PAGE = f"SELECT * FROM ({_UNION}) AS h ORDER BY at, rank, k LIMIT ?2"
_PAGE_AFTER = (
    f"SELECT * FROM ({_UNION}) AS h WHERE (at, rank, k) > (?3, ?4, ?5) ORDER BY at, rank, k LIMIT ?2"
)


def page(
    conn: Connection, task_id: str, *, after: Cursor | None, limit: int
) -> tuple[list[tuple[Cursor, HistoryItem]], bool]:
    """At most `limit` items of the task's history after `after` (None: from the first), oldest first, each
    with its cursor; and whether more follow. A task without history (or none) gives no items."""
    if after is None:
        rows = conn.execute(_PAGE, (task_id, limit + 1)).fetchall()
    else:
        rows = conn.execute(_PAGE_AFTER, (task_id, limit + 1, after.at, after.rank, after.key)).fetchall()
    calls = _host_calls(conn, [int(row[2]) for row in rows[:limit] if row[1] == _HOST_CALL_RANK])
    items = [
        (
            Cursor(float(row[0]), int(row[1]), int(row[2])),
            _call_item(calls[int(row[2])]) if row[1] == _HOST_CALL_RANK else _item(row),
        )
        for row in rows[:limit]
    ]
    return items, len(rows) > limit


def task_page(conn: Connection, task_id: str, after: str | None, limit: int) -> HistoryPage:
    """`task_history`'s reply: a `page` of the task's history after the cursor `after` (a page's `next`;
    None: from the first item).

    Raises:
        NotFoundError: the task does not exist (field task_id); its history went with it.
        ProtocolError: `after` is not a cursor (field after).
    """
    cursor = None if after is None else parse_cursor(after)
    if conn.execute("SELECT 1 FROM tasks WHERE id = ?", (task_id,)).fetchone() is None:
        raise NotFoundError(f"task {task_id!r} does not exist", field="task_id")
    items, more = page(conn, task_id, after=cursor, limit=limit)
    return {"items": [item for _, item in items], "next": items[-1][0].encode() if more else None}


_HOST_CALL_RANK = 4


def _host_calls(conn: Connection, ids: list[int]) -> dict[int, HostCallInfo]:
    """The host calls a page names, by id (one statement, none when the page names none)."""
    if not ids:
        return {}
    marks = ", ".join("?" * len(ids))
    rows = conn.execute(f"SELECT {host_calls.COLUMNS} FROM host_calls WHERE id IN ({marks})", ids)
    return {int(row[0]): host_calls.info(row) for row in rows}


def _call_item(call: HostCallInfo) -> HistoryItem:
    assert call["answered_at"] is not None  # a recorded call has ended
    return {"at": call["answered_at"], "kind": "host_call", "seq": None, "detail": dict(call)}


def _item(row: Any) -> HistoryItem:
    at, _, key, kind, status, detail = row[:6]
    if detail is not None:
        parsed = json.loads(detail)
        if kind == "transition":
            parsed = transition_item(parsed)
        return {"at": rfc3339(at), "kind": cast(Kind, kind), "seq": key, "detail": parsed}
    run_id, agent, step_id, attempt, trigger, entry_seq, reason, outcome_reason = row[6:]
    run: dict[str, Any] = {"run_id": run_id, "status": status, "agent_profile_id": agent, "step_id": step_id}
    if status == "queued":
        run |= {"trigger": trigger, "entry_seq": entry_seq, "reason": reason}
    elif status == "claimed":
        run["attempt"] = attempt
    else:
        run |= {"attempt": attempt, "outcome_reason": outcome_reason}
    return {"at": rfc3339(at), "kind": "run", "seq": None, "detail": run}


# Step entries that allocated no record (the step's on_enter declares no engine-owned action): only their
# transition item keeps them. Read by the `entries` view beside the records, in the same order.
_RECORDLESS = {
    "sqlite": (
        "SELECT task_id, json_extract(detail, '$.to_step') AS step_id, seq, detail FROM task_history"
        " WHERE kind = 'transition' AND json_extract(detail, '$.entry_seq') IS NULL"
        " AND NOT COALESCE(json_extract(detail, '$.queued'), 0)"
    ),
    "postgresql": (
        "SELECT task_id, CAST(detail AS json) ->> 'to_step' AS step_id, seq, detail FROM task_history"
        " WHERE kind = 'transition' AND CAST(detail AS json) ->> 'entry_seq' IS NULL"
        " AND COALESCE(CAST(detail AS json) ->> 'queued', 'false') = 'false'"
    ),
}

RecordlessCursor = tuple[str, int]
"""Where a page of record-less entries ends: (task id, history seq)."""


def recordless_entries_page(
    conn: Connection, *, task_id: str | None, after: RecordlessCursor | None, limit: int
) -> tuple[list[tuple[RecordlessCursor, dict[str, Any]]], bool]:
    """Up to `limit` step entries that allocated no entry record (of one task, or all), from the history's
    transitions (not a WIP queueing), after `after`, in (task, seq) order, the history's key: each with its
    cursor and its transition's detail (`transition_detail`); and whether more follow."""
    sql = _RECORDLESS["postgresql" if on_postgres(conn) else "sqlite"]
    where: list[str] = []
    args: list[str | int] = []
    if task_id is not None:
        where.append("task_id = ?")
        args.append(task_id)
    if after is not None:
        where.append("(task_id, seq) > (?, ?)")
        args.extend(after)
    scope = "".join(f" AND {clause}" for clause in where)
    rows = conn.execute(f"{sql}{scope} ORDER BY task_id, seq LIMIT ?", [*args, limit + 1]).fetchall()
    found = [((str(row[0]), int(row[2])), transition_item(json.loads(row[3]))) for row in rows[:limit]]
    return found, len(rows) > limit
