"""A run's life after it is queued: claims with a fencing token and a lease, renewals, finishes, retries,
cancellation and expired leases. Writer thread: every function runs inside the caller's transaction and
returns what changed, for the Trio side to publish (actors/runtime/runs.py).

Every status change is a compare-and-set on the row's current status (and, for a holder's call, its
current `claim_token`), checked by the statement's own row count, so two claimers never get one run, on
either backend: on PostgreSQL the claim's candidate is locked `FOR UPDATE SKIP LOCKED`, so concurrent
claimers of one agent take different runs instead of waiting for, then losing, the same one. The rules
(Kandev's runs queue, protocol/runs.py `RunPolicy`):

- a claim takes the oldest eligible run of the agent (by request time, then id): queued with its retry
  time come, or claimed with its lease expired (a dead holder: `run_lease_expired`, an attempt used); on
  the way, a run past the age limit is cancelled `run_too_old`. (Kandev also cancels at claim a run whose
  step is no longer its task's, `workflow_step_changed`; here a task's runs are cancelled the moment it
  leaves the step entry that queued them, `entry_left`, store/runs.py `leave_entries`, so none is left to
  find);
- a finish or renewal names the claim's token; a stale token (another claim since, or the run cancelled)
  is a `conflict` naming `claim_token` and changes nothing; the same finish again is a replay;
- a failed attempt of a superseded run (its entry was left) is cancelled `entry_left`; one with retries
  left, retryable and within the age limit is queued again for
  `retry_at` (the host's, else the backoff); otherwise it fails for good, and an `agent_error` run is
  queued for the task's CEO agent when it has one.
"""

from __future__ import annotations

import secrets
from typing import Literal

import attrs

from onceflow.protocol.errors import ConflictError, NotFoundError
from onceflow.protocol.runs import RunPolicy
from onceflow.store import keys, runs
from onceflow.store.connection import Connection
from onceflow.store.records import RunRecord
from onceflow.store.runs import COLUMNS, Change, EnqueueResult, RunRequest, run_from_row
from onceflow.store.urls import on_postgres

CANDIDATES = 64
"""The most stale runs one claim cancels before it gives up for this call (the next claim goes on)."""


@attrs.frozen
class Claimed:
    """What a claim did: the run it claimed (None: none eligible), the changes on the way (the stale runs
    it cancelled, an expired lease it took over), and when the agent's next run becomes eligible (Unix
    seconds; None: no unresolved run of the agent is waiting for a time)."""

    run: RunRecord | None
    changes: tuple[Change, ...] = ()
    next_eligible_at: float | None = None


def claim(conn: Connection, agent_profile_id: str, now: float, lease: float, policy: RunPolicy) -> Claimed:
    """Claim the agent's oldest eligible run for `lease` seconds (module docstring), minting its token."""
    changes: list[Change] = []
    lock = " FOR UPDATE SKIP LOCKED" if on_postgres(conn) else ""
    for _ in range(CANDIDATES):
        row = conn.execute(
            f"SELECT {COLUMNS} FROM runs WHERE agent_profile_id = ?1 AND status IN ('queued', 'claimed')"
            " AND ((status = 'queued' AND (retry_at IS NULL OR retry_at <= ?2))"
            " OR (status = 'claimed' AND lease_expires_at <= ?2))"
            " ORDER BY requested_at, id LIMIT 1" + lock,
            (agent_profile_id, now),
        ).fetchone()
        if row is None:
            return Claimed(None, tuple(changes), next_eligible(conn, agent_profile_id))
        run = run_from_row(row)
        if run.status == "claimed":  # its holder's lease ran out: end the claim, then look again
            changes.extend(_expired(conn, run, now, policy))
            continue
        if now - run.requested_at >= policy.max_age:
            if _cancel(conn, run, "run_too_old", now):
                changes.append(
                    Change("cancelled", run.id, run.task_id, run.agent_profile_id, run.attempt, "run_too_old")
                )
            continue
        if run.attempt >= policy.max_attempts:
            changes.extend(_fail(conn, run, "too_many_attempts", run.last_error, now))
            continue
        token = secrets.token_hex(8)
        claimed = conn.execute(
            "UPDATE runs SET status = 'claimed', claim_token = ?, attempt = attempt + 1, claimed_at = ?,"
            f" lease_expires_at = ?, retry_at = NULL WHERE id = ? AND status = 'queued' RETURNING {COLUMNS}",
            (token, now, now + lease, run.id),
        ).fetchone()
        if claimed is None:  # another claimer took it between the read and the write (PostgreSQL)
            continue
        record = run_from_row(claimed)
        changes.append(
            Change(
                "claimed",
                record.id,
                record.task_id,
                record.agent_profile_id,
                record.attempt,
                lease_expires_at=record.lease_expires_at,
            )
        )
        return Claimed(record, tuple(changes))
    return Claimed(None, tuple(changes), now)


def next_eligible(conn: Connection, agent_profile_id: str) -> float | None:
    """When the agent's next waiting run becomes eligible (a retry's time, or a lease's end), or None."""
    (at,) = conn.execute(
        "SELECT MIN(CASE status WHEN 'queued' THEN retry_at ELSE lease_expires_at END) FROM runs"
        " WHERE agent_profile_id = ? AND status IN ('queued', 'claimed')",
        (agent_profile_id,),
    ).fetchone()
    return None if at is None else float(at)


@attrs.frozen
class Renewed:
    """A renewal: the run, and its new lease end (Unix seconds)."""

    run: RunRecord
    lease_expires_at: float


def renew(conn: Connection, run_id: int, token: str, now: float, lease: float) -> Renewed:
    """Extend the claim's lease to `now + lease`.

    Raises:
        NotFoundError: no run `run_id` (field run_id).
        ConflictError: `token` is not the run's current claim (field claim_token), also when another
            runtime's transaction ended the claim between the read and the write (PostgreSQL).
    """
    held = _held(conn, run_id, token)
    renewed = conn.execute(
        "UPDATE runs SET lease_expires_at = ? WHERE id = ? AND status = 'claimed' AND claim_token = ?",
        (now + lease, run_id, token),
    ).rowcount
    if renewed != 1:
        raise ConflictError(f"run {run_id} changed meanwhile", field="claim_token")
    return Renewed(held, now + lease)


def release(conn: Connection, run_id: int, token: str) -> bool:
    """Hand back the claim under `token` as if it never happened (its caller was cancelled before it saw
    it): queued again, the attempt not counted. False when the claim already ended."""
    return (
        conn.execute(
            "UPDATE runs SET status = 'queued', claim_token = NULL, attempt = attempt - 1,"
            " lease_expires_at = NULL, outcome_reason = 'claim_released'"
            " WHERE id = ? AND status = 'claimed' AND claim_token = ?",
            (run_id, token),
        ).rowcount
        == 1
    )


def _held(conn: Connection, run_id: int, token: str) -> RunRecord:
    """The run, claimed under `token`. A lease that ran out while nobody claimed the run since still holds:
    the run is taken from its holder only by another claim (or the lease sweep, which clears the token).

    Raises:
        NotFoundError: no run `run_id` (field run_id).
        ConflictError: the run is not claimed under `token` (field claim_token).
    """
    run = runs.get_run(conn, run_id)
    if run is None:
        raise NotFoundError(f"run {run_id} does not exist", field="run_id")
    if run.status != "claimed" or run.claim_token != token:
        why = "claimed under another token" if run.status == "claimed" else run.status
        raise ConflictError(
            f"run {run_id} is not claimed under this token (it is {why})", field="claim_token"
        )
    return run


@attrs.frozen
class Finished:
    """What a finish did: the run after it, whether it repeated the recorded finish (`replay`), the changes
    to publish, and the escalation run queued for the CEO agent."""

    run: RunRecord
    replay: bool
    changes: tuple[Change, ...]
    escalation: EnqueueResult | None = None


def finish(
    conn: Connection,
    run_id: int,
    token: str | None,
    status: Literal["finished", "failed"],
    *,
    error: str | None,
    retryable: bool,
    retry_at: float | None,
    now: float,
    policy: RunPolicy,
    draw: float,
) -> Finished:
    """Resolve the attempt under `token` (None: unfenced, a claimed run's current claim). `draw` in [0, 1)
    picks the jitter of a retry's backoff.

    Raises:
        NotFoundError: no run `run_id`, or (unfenced) it is not claimed (field run_id).
        ConflictError: `token` is not its current claim, or the same claim's finish recorded another
            outcome (field claim_token / status).
    """
    run = runs.get_run(conn, run_id)
    if run is None or (token is None and run.status != "claimed"):
        raise NotFoundError(f"no claimed run {run_id}", field="run_id")
    token = run.claim_token if token is None else token
    if run.status != "claimed" and token is not None and run.claim_token == token:
        if _same_outcome(run, status):
            return Finished(run, True, ())
        raise ConflictError(f"run {run_id}'s claim already ended ({run.status})", field="status")
    held = _held(conn, run_id, token or "")
    if status == "finished":
        return _ended(_resolve(conn, held, "finished", None, None, now), "finished")
    if held.superseded:  # its entry was left: there is nothing to retry it for
        return _ended(_resolve(conn, held, "cancelled", "entry_left", error, now), "cancelled", "entry_left")
    if not retryable:
        return _failed_for_good(conn, held, "not_retryable", error, now)
    if held.retries >= policy.max_retries:
        return _failed_for_good(conn, held, "retries_exhausted", error, now)
    when = retry_at if retry_at is not None else now + policy.delay(held.retries + 1, draw)
    if when - held.requested_at >= policy.max_age:  # it would be too old to run by then
        return _ended(
            _resolve(conn, held, "cancelled", "run_too_old", error, now), "cancelled", "run_too_old"
        )
    queued = conn.execute(
        "UPDATE runs SET status = 'queued', retries = retries + 1, retry_at = ?, lease_expires_at = NULL,"
        " last_error = ?, outcome_reason = 'retry_scheduled'"
        f" WHERE id = ? AND status = 'claimed' AND claim_token = ? RETURNING {COLUMNS}",
        (when, error, run_id, token),
    ).fetchone()
    if queued is None:  # another runtime's transaction ended the claim after the read (PostgreSQL)
        raise ConflictError(f"run {run_id} changed meanwhile", field="claim_token")
    return _ended(run_from_row(queued), "retry_scheduled", "retry_scheduled")


def _ended(run: RunRecord, kind: str, reason: str = "") -> Finished:
    """The `Finished` of an attempt that left `run` as it is, with its one change."""
    change = Change(
        kind,
        run.id,
        run.task_id,
        run.agent_profile_id,
        run.attempt,
        reason,
        error=run.last_error,
        retry_at=run.retry_at,
        retries=run.retries,
        superseded=run.superseded,
    )
    return Finished(run, False, (change,))


def _same_outcome(run: RunRecord, status: str) -> bool:
    """Whether a finish with `status` is what the run's last claim recorded: finished as finished, failed as
    failed for good, retried or cancelled for age."""
    if status == "finished":
        return run.status == "finished"
    return run.status in ("failed", "cancelled") or (
        run.status == "queued" and run.outcome_reason == "retry_scheduled"
    )


def _resolve(
    conn: Connection, run: RunRecord, status: str, reason: str | None, error: str | None, now: float
) -> RunRecord:
    """Set a claimed run's final status (compare-and-set on its claim); the row after it."""
    row = conn.execute(
        f"UPDATE runs SET status = ?, finished_at = ?, lease_expires_at = NULL, outcome_reason = ?,"
        f" last_error = COALESCE(?, last_error) WHERE id = ? AND status = ? AND COALESCE(claim_token, '') = ?"
        f" RETURNING {COLUMNS}",
        (status, now, reason, error, run.id, run.status, run.claim_token or ""),
    ).fetchone()
    if row is None:
        raise ConflictError(f"run {run.id} changed meanwhile", field="claim_token")
    return run_from_row(row)


def _failed_for_good(
    conn: Connection, run: RunRecord, reason: str, error: str | None, now: float
) -> Finished:
    changes = _fail(conn, run, reason, error, now)
    failed = runs.get_run(conn, run.id)
    assert failed is not None
    escalation = None
    for change in changes:
        if change.kind == "escalated":
            escalation = EnqueueResult("queued", change.run_id)
    return Finished(failed, False, tuple(changes), escalation)


def _fail(conn: Connection, run: RunRecord, reason: str, error: str | None, now: float) -> list[Change]:
    """Fail `run` for good and queue the escalation for its task's CEO agent, when it has one."""
    failed = _resolve(conn, run, "failed", reason, error, now)
    changes = [
        Change(
            "failed",
            failed.id,
            failed.task_id,
            failed.agent_profile_id,
            failed.attempt,
            reason,
            error=failed.last_error,
        )
    ]
    ceo = None
    if failed.task_id is not None:
        found = conn.execute("SELECT ceo_agent_id FROM tasks WHERE id = ?", (failed.task_id,)).fetchone()
        ceo = found[0] if found else None
    if ceo:
        request = RunRequest(
            agent_profile_id=ceo,
            task_id=failed.task_id,
            step_id=failed.step_id,
            reason="agent_error",
            payload={
                "agent_profile_id": failed.agent_profile_id,
                "run_id": failed.id,
                "error": failed.last_error,
            },
            idempotency_key=keys.escalation_key(failed.id),
            exclude_from_coalescing=True,
            trigger="run_failed",
            admission_seq=failed.admission_seq,
        )
        queued = runs.enqueue_run(conn, request, now)
        changes.append(
            Change("escalated", queued.run_id, failed.task_id, ceo, 0, queued.outcome, failed.step_id)
        )
    return changes


def _cancel(conn: Connection, run: RunRecord, reason: str, now: float) -> bool:
    """Cancel an unresolved run (compare-and-set on its status); False when it was resolved meanwhile. A
    claimed run's token goes: its holder's finish is then a conflict, never a replay (a kept token means
    the holder's own finish ended the claim)."""
    return (
        conn.execute(
            "UPDATE runs SET status = 'cancelled', outcome_reason = ?, finished_at = ?,"
            " lease_expires_at = NULL,"
            " claim_token = CASE status WHEN 'claimed' THEN NULL ELSE claim_token END"
            " WHERE id = ? AND status IN ('queued', 'claimed')",
            (reason, now, run.id),
        ).rowcount
        == 1
    )


def cancel(conn: Connection, run_id: int, reason: str, now: float) -> tuple[bool, Change | None]:
    """Cancel run `run_id` for the host: (True, its change) when it was queued or claimed, (False, None) when
    it was already cancelled.

    Raises:
        NotFoundError: no run `run_id` (field run_id).
        ConflictError: it is finished or failed (field run_id).
    """
    run = runs.get_run(conn, run_id)
    if run is None:
        raise NotFoundError(f"run {run_id} does not exist", field="run_id")
    if run.status == "cancelled":
        return False, None
    if run.status not in runs.UNRESOLVED or not _cancel(conn, run, reason, now):
        raise ConflictError(f"run {run_id} is {run.status}: it cannot be cancelled", field="run_id")
    return True, Change("cancelled", run.id, run.task_id, run.agent_profile_id, run.attempt, reason)


@attrs.frozen
class Expired:
    """What a lease sweep did, and when the next lease held now ends (Unix seconds; None: none is held)."""

    changes: list[Change]
    next_at: float | None


def expire_leases(conn: Connection, now: float, limit: int, policy: RunPolicy) -> Expired:
    """Return to the queue (or end) up to `limit` claimed runs whose lease expired: queued again, their
    attempt used (`lease_expired`); cancelled when their entry was left meanwhile (`entry_left`) or they are
    past the age limit (`run_too_old`); failed once they had `max_attempts` claims."""
    rows = conn.execute(
        f"SELECT {COLUMNS} FROM runs WHERE status = 'claimed' AND lease_expires_at <= ?"
        " ORDER BY lease_expires_at LIMIT ?",
        (now, limit),
    ).fetchall()
    changes = [change for run in map(run_from_row, rows) for change in _expired(conn, run, now, policy)]
    (next_at,) = conn.execute("SELECT MIN(lease_expires_at) FROM runs WHERE status = 'claimed'").fetchone()
    return Expired(changes, None if next_at is None else float(next_at))


def _expired(conn: Connection, run: RunRecord, now: float, policy: RunPolicy) -> list[Change]:
    """End the claim of `run`, whose lease ran out: cancelled when its entry was left meanwhile
    (`entry_left`) or it is past the age limit (`run_too_old`), failed when it had `max_attempts` claims,
    else queued again (`lease_expired`). The token goes: its holder's late renew or finish is a conflict."""
    reason = (
        "entry_left" if run.superseded else "run_too_old" if now - run.requested_at >= policy.max_age else ""
    )
    if reason:
        cancelled = _cancel(conn, run, reason, now)
        return (
            [Change("cancelled", run.id, run.task_id, run.agent_profile_id, run.attempt, reason)]
            if cancelled
            else []
        )
    if run.attempt >= policy.max_attempts:
        return _fail(conn, run, "too_many_attempts", run.last_error, now)
    requeued = conn.execute(
        "UPDATE runs SET status = 'queued', lease_expires_at = NULL, claim_token = NULL,"
        " outcome_reason = 'lease_expired' WHERE id = ? AND status = 'claimed' AND claim_token = ?",
        (run.id, run.claim_token),
    ).rowcount
    return (
        [Change("lease_expired", run.id, run.task_id, run.agent_profile_id, run.attempt)] if requeued else []
    )


def cancel_task_runs(conn: Connection, task_id: str, now: float) -> list[Change]:
    """Cancel every queued or claimed run of the task (it is being deleted: `task_deleted`)."""
    rows = conn.execute(
        "UPDATE runs SET status = 'cancelled', outcome_reason = 'task_deleted', finished_at = ?,"
        " lease_expires_at = NULL WHERE task_id = ? AND status IN ('queued', 'claimed')"
        " RETURNING id, agent_profile_id, attempt",
        (now, task_id),
    ).fetchall()
    return [
        Change("cancelled", run_id, task_id, agent, attempt, "task_deleted")
        for run_id, agent, attempt in rows
    ]
