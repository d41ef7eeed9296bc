"""Host calls that ended: one row each, for `list_host_calls` and a task's history. Writer thread: every
function runs inside the caller's transaction (and the read-only views' own connection).

The host role over `onceflow serve` (actors/runtime/host_broker.py) records a call once it has ended —
answered, refused, unavailable, timed out or cancelled — with how many times it was offered, which host
held it last, when it was made and ended (Unix seconds) and its latency (seconds, monotonic), so a host that
reconnects reads what happened while it was away. A call still pending lives only in the broker's memory
(its dispatch waits on it); the same call id may be recorded more than once (the same declared action at a
later recovery, a repeated preflight): each row is one call. Retention deletes rows by `answered_at`
(store/retention/retention.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, cast

import attrs

from onceflow.protocol.host_calls import CallKind, CallStatus
from onceflow.protocol.results import HostCallError, HostCallInfo
from onceflow.protocol.times import rfc3339
from onceflow.store.backends.connection import Connection

COLUMNS = "id, call_id, kind, task_id, status, attempts, host_id, created_at, answered_at, latency, error"
"""The columns `info` reads, in its order (the history's union reads them too: store/tasks/history.py)."""

_INSERT = (
    "INSERT INTO host_calls (call_id, kind, task_id, status, attempts, host_id, created_at, answered_at,"
    " latency, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


@attrs.frozen
class EndedCall:
    """One ended call, as recorded: times in Unix seconds, `latency` in seconds (monotonic)."""

    call_id: str
    kind: CallKind
    task_id: str | None
    status: CallStatus
    attempts: int
    host_id: str | None
    created_at: float
    answered_at: float
    latency: float
    error: HostCallError | None


def record(conn: Connection, calls: Sequence[EndedCall]) -> None:
    """Append one row per ended call (one statement for the batch)."""
    conn.executemany(
        _INSERT,
        [
            (
                call.call_id,
                call.kind,
                call.task_id,
                call.status,
                call.attempts,
                call.host_id,
                call.created_at,
                call.answered_at,
                call.latency,
                None if call.error is None else json.dumps(call.error, separators=(",", ":")),
            )
            for call in calls
        ],
    )


def page(
    conn: Connection,
    *,
    status: CallStatus | None,
    task_id: str | None,
    kind: CallKind | None,
    after_id: int | None,
    limit: int,
) -> tuple[list[HostCallInfo], int | None]:
    """At most `limit` recorded calls after `after_id` (exclusive; None: from the first) in record order,
    filtered by every argument given; and the id to pass as `after_id` for the next page (None: this was
    the last)."""
    where = ["id > ?"]
    params: list[object] = [-1 if after_id is None else after_id]
    for column, value in (("status", status), ("task_id", task_id), ("kind", kind)):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    rows = conn.execute(
        f"SELECT {COLUMNS} FROM host_calls WHERE {' AND '.join(where)} ORDER BY id LIMIT ?",
        (*params, limit + 1),
    ).fetchall()
    calls = [info(row) for row in rows[:limit]]
    return calls, (calls[-1]["id"] if len(rows) > limit else None)


def info(row: Sequence[Any]) -> HostCallInfo:
    """A row of `COLUMNS` as the protocol shows it."""
    id_, call_id, kind, task_id, status, attempts, host_id, created_at, answered_at, latency, error = row
    return {
        "id": int(id_),
        "call_id": call_id,
        "kind": cast(CallKind, kind),
        "task_id": task_id,
        "status": cast(CallStatus, status),
        "attempts": int(attempts),
        "host_id": host_id,
        "created_at": rfc3339(created_at),
        "answered_at": rfc3339(answered_at),
        "latency_seconds": round(float(latency), 6),
        "error": None if error is None else cast(HostCallError, json.loads(error)),
    }
