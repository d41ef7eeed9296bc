"""The runs queue: idempotent, coalescing enqueue; atomic claim; finish.

Rules (kandev-engine-notes.md, "Runs queue"; on-enter-action-dispatch.md AC-B4, AC-H6, AC-H9):
- an idempotency key seen within 24 h makes the enqueue a success that inserts nothing;
- within 5 s, the newest queued run with the same (agent_profile_id, reason) absorbs the enqueue
  (count + 1, payload replaced) — unless either side has `exclude_from_coalescing` set. That flag is a
  discrete column read by both `should_coalesce` and the coalescing SQL, never encoded in the key.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Literal

import attrs

from onceflow.store.records import RunRecord
from onceflow.store.savepoint import savepoint

IDEMPOTENCY_WINDOW_SECONDS = 24 * 60 * 60
COALESCE_WINDOW_SECONDS = 5.0

_COLUMNS = (
    "id, agent_profile_id, task_id, workflow_step_id, reason, payload, idempotency_key,"
    " exclude_from_coalescing, status, coalesced_count, requested_at"
)


@attrs.frozen
class RunRequest:
    """What to enqueue. `payload` None is stored as SQL NULL (on-enter spec AC-H2), never as `{}`."""

    agent_profile_id: str
    task_id: str | None
    step_id: str | None
    reason: str
    payload: dict[str, Any] | None = None
    idempotency_key: str | None = None
    exclude_from_coalescing: bool = False


@attrs.frozen
class EnqueueResult:
    """`queued` inserted run_id; `suppressed` found run_id under the same key; `coalesced` merged into it."""

    outcome: Literal["queued", "suppressed", "coalesced"]
    run_id: int
    coalesced_count: int = 0


def _run(row: tuple[Any, ...]) -> RunRecord:
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
    )


def _payload_json(payload: dict[str, Any] | None) -> str | None:
    return None if payload is None else json.dumps(payload, sort_keys=True, separators=(",", ":"))


def should_coalesce(request: RunRequest) -> bool:
    """Whether this request may be merged into an earlier queued run (AC-H9's predicate)."""
    return not request.exclude_from_coalescing


def enqueue_run(conn: sqlite3.Connection, request: RunRequest, now: float) -> EnqueueResult:
    """Enqueue inside the caller's transaction. `now` is Unix seconds.

    An expired key (older than 24 h) is released from its old run so the new run can take it. Atomic: an
    enqueue that raises leaves none of its writes behind (each path is one write, or two in a savepoint), so
    a fan-out needs no savepoint of its own per participant.
    """
    key = request.idempotency_key
    if key and not should_coalesce(request):  # the common keyed case: insert first, look only on a conflict
        inserted = _insert(conn, request, now, skip_taken_key=True)
        if inserted is not None:
            return inserted
    if key:
        row = conn.execute("SELECT id, requested_at FROM runs WHERE idempotency_key = ?", (key,)).fetchone()
        if row is not None:
            if now - row[1] < IDEMPOTENCY_WINDOW_SECONDS:
                return EnqueueResult("suppressed", row[0])
            with savepoint(conn, "rekey"):
                conn.execute("UPDATE runs SET idempotency_key = NULL WHERE id = ?", (row[0],))
                queued = _insert(conn, request, now)
            assert queued is not None  # without skip_taken_key a conflict raises
            return queued
    if should_coalesce(request):
        row = conn.execute(
            "SELECT id, coalesced_count FROM runs WHERE agent_profile_id = ? AND reason = ?"
            " AND status = 'queued' AND exclude_from_coalescing = 0 AND requested_at >= ?"
            " ORDER BY requested_at DESC, id DESC LIMIT 1",
            (request.agent_profile_id, request.reason, now - COALESCE_WINDOW_SECONDS),
        ).fetchone()
        if row is not None:
            conn.execute(
                "UPDATE runs SET coalesced_count = coalesced_count + 1, payload = ? WHERE id = ?",
                (_payload_json(request.payload), row[0]),
            )
            return EnqueueResult("coalesced", row[0], row[1] + 1)
    queued = _insert(conn, request, now)
    assert queued is not None
    return queued


def _insert(
    conn: sqlite3.Connection, request: RunRequest, now: float, *, skip_taken_key: bool = False
) -> EnqueueResult | None:
    """Insert the run. `skip_taken_key`: a key already taken inserts nothing and returns None."""
    upsert = " ON CONFLICT (idempotency_key) DO NOTHING" if skip_taken_key else ""
    cur = conn.execute(
        "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, payload, idempotency_key,"
        " exclude_from_coalescing, requested_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)" + upsert,
        (
            request.agent_profile_id,
            request.task_id,
            request.step_id,
            request.reason,
            _payload_json(request.payload),
            request.idempotency_key or None,
            int(request.exclude_from_coalescing),
            now,
        ),
    )
    return EnqueueResult("queued", int(cur.lastrowid or 0)) if cur.rowcount == 1 else None


def claim_run(conn: sqlite3.Connection, agent_profile_id: str, now: float) -> RunRecord | None:
    """Claim the oldest queued run of an agent profile (queued → claimed), or None if there is none.

    Atomic because the select and the update share the caller's BEGIN IMMEDIATE transaction.
    """
    row = conn.execute(
        f"SELECT {_COLUMNS} FROM runs WHERE agent_profile_id = ? AND status = 'queued'"
        " ORDER BY requested_at, id LIMIT 1",
        (agent_profile_id,),
    ).fetchone()
    if row is None:
        return None
    conn.execute("UPDATE runs SET status = 'claimed', claimed_at = ? WHERE id = ?", (now, row[0]))
    return attrs.evolve(_run(row), status="claimed")


def finish_run(conn: sqlite3.Connection, run_id: int, status: str, now: float) -> bool:
    """Mark a claimed run finished or failed. False if no claimed run has that id."""
    cur = conn.execute(
        "UPDATE runs SET status = ?, finished_at = ? WHERE id = ? AND status = 'claimed'",
        (status, now, run_id),
    )
    return cur.rowcount == 1


def list_runs(
    conn: sqlite3.Connection,
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
    rows = conn.execute(f"SELECT {_COLUMNS} FROM runs{where} ORDER BY requested_at, id", args).fetchall()
    return [_run(row) for row in rows]


def run_as_dict(run: RunRecord) -> dict[str, Any]:
    """The run as a JSON-ready mapping (for replies)."""
    return attrs.asdict(run)
