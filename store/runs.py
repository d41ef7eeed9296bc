"""The runs queue: idempotent, coalescing enqueue; atomic claim; finish. Writer thread: every function runs
inside the caller's transaction.

Rules (kandev-engine-notes.md, "Runs queue"; on-enter-action-dispatch.md AC-B4, AC-H6, AC-H9):
- every idempotency key is kept with the run it produced (`runs.idempotency_key`) or, for an enqueue merged
  by coalescing, in `coalesced_keys` with the run it was merged into; while that run is unresolved, and for
  24 h after it resolves, the key makes an enqueue a success that changes nothing;
- within 5 s, the newest queued run of the same task with the same (agent_profile_id, reason) absorbs the
  enqueue (count + 1, payload replaced) — never a run of another task, and not when either side has
  `exclude_from_coalescing` set. That flag is a discrete column read by both `should_coalesce` and the
  coalescing SQL, never encoded in the key.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import attrs

from onceflow.protocol.results import RunInfo
from onceflow.store.connection import Connection
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
    if status in ("queued", "claimed"):
        return True
    return (
        now - max(seen_at, finished_at if finished_at is not None else seen_at) < IDEMPOTENCY_WINDOW_SECONDS
    )


def enqueue_run(conn: Connection, request: RunRequest, now: float) -> EnqueueResult:
    """Enqueue inside the caller's transaction. `now` is Unix seconds.

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
    merged = conn.execute(
        "SELECT k.run_id, k.seen_at, r.status, r.finished_at FROM coalesced_keys k"
        " JOIN runs r ON r.id = k.run_id WHERE k.idempotency_key = ?",
        (key,),
    ).fetchone()
    if merged is not None and key_honoured(
        status=merged[2], seen_at=merged[1], finished_at=merged[3], now=now
    ):
        return EnqueueResult("suppressed", merged[0])
    if merged is None and not should_coalesce(request):  # the common keyed case: insert, look on a conflict
        inserted = _insert(conn, request, now, skip_taken_key=True)
        if inserted is not None:
            return inserted
    own = conn.execute(
        "SELECT id, requested_at, status, finished_at FROM runs WHERE idempotency_key = ?", (key,)
    ).fetchone()
    if own is not None and key_honoured(status=own[2], seen_at=own[1], finished_at=own[3], now=now):
        return EnqueueResult("suppressed", own[0])
    with savepoint(conn, "enqueue"):  # release the expired key, then merge or insert under it: all or none
        if merged is not None:
            conn.execute("DELETE FROM coalesced_keys WHERE idempotency_key = ?", (key,))
        if own is not None:
            conn.execute("UPDATE runs SET idempotency_key = NULL WHERE id = ?", (own[0],))
        result = _coalesce(conn, request, now)
        if result is None:
            return _queue(conn, request, now)
        conn.execute(
            "INSERT INTO coalesced_keys (idempotency_key, run_id, seen_at) VALUES (?, ?, ?)",
            (key, result.run_id, now),
        )
    return result


def _coalesce(conn: Connection, request: RunRequest, now: float) -> EnqueueResult | None:
    """Merge into the newest coalescible queued run of the same task, agent and reason, or None."""
    if not should_coalesce(request):
        return None
    row = conn.execute(
        "SELECT id, coalesced_count FROM runs WHERE agent_profile_id = ? AND reason = ? AND task_id IS ?"
        " AND status = 'queued' AND exclude_from_coalescing = 0 AND requested_at >= ?"
        " ORDER BY requested_at DESC, id DESC LIMIT 1",
        (request.agent_profile_id, request.reason, request.task_id, now - COALESCE_WINDOW_SECONDS),
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


def _insert(
    conn: Connection, request: RunRequest, now: float, *, skip_taken_key: bool = False
) -> EnqueueResult | None:
    """Insert the run as queued. `skip_taken_key`: a key already on a run inserts nothing, returns None."""
    upsert = " ON CONFLICT (idempotency_key) DO NOTHING" if skip_taken_key else ""
    cur = conn.execute(
        "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, payload, idempotency_key,"
        " exclude_from_coalescing, requested_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)" + upsert,
        (
            request.agent_profile_id,
            request.task_id,
            request.step_id,
            request.reason,
            payload_json(request.payload),
            request.idempotency_key or None,
            int(request.exclude_from_coalescing),
            now,
        ),
    )
    return EnqueueResult("queued", int(cur.lastrowid or 0)) if cur.rowcount == 1 else None


def claim_run(conn: Connection, agent_profile_id: str, now: float) -> RunRecord | None:
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


def finish_run(conn: Connection, run_id: int, status: str, now: float) -> bool:
    """Mark a claimed run finished or failed. False if no claimed run has that id."""
    cur = conn.execute(
        "UPDATE runs SET status = ?, finished_at = ? WHERE id = ? AND status = 'claimed'",
        (status, now, run_id),
    )
    return cur.rowcount == 1


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
    rows = conn.execute(f"SELECT {_COLUMNS} FROM runs{where} ORDER BY requested_at, id", args).fetchall()
    return [_run(row) for row in rows]


def run_info(run: RunRecord) -> RunInfo:
    """The run as replies show it (a dict display: calling a typed dict class costs a dict(**kwargs))."""
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
        "requested_at": run.requested_at,
    }
