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
  leaves the step entry that queued them, `entry_left`, store/runs/runs.py `leave_entries`, so none is left to
  find);
- a finish or renewal names the claim's token; a stale token (another claim since, or the run cancelled)
  is a `conflict` naming `claim_token` and changes nothing; the same finish again is a replay, also when
  sent at once (a finish reads the run's row locked `FOR UPDATE` on PostgreSQL, so the second waits for
  the first and sees its finish); a finish without a token is refused `fence_required` unless the host opts
  out (`unfenced`);
- every time is judged by store/backends/clock.py's rule: the caller's `now` (the runtime's monotonic clock)
on
  SQLite, the server's clock on PostgreSQL; a claim or renewal records its lease's length
  (`wait_seconds`), so a lease written under a clock that later stepped back is cut to that length;
- a failed attempt of a superseded run (its entry was left) is cancelled `entry_left`; one with retries
  left, retryable and within the age limit is queued again for
  `retry_at` (the host's, else the backoff); otherwise it fails for good, and an `agent_error` run is
  queued for the task's CEO agent when it has one.
"""

from __future__ import annotations

import secrets
from typing import Literal

import attrs

from onceflow.protocol.errors import ConflictError, FenceRequiredError, NotFoundError
from onceflow.protocol.runs import RunPolicy
from onceflow.store.backends.clock import SERVER_CLOCK, Clocked, clamp_leases, judge
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.urls import on_postgres
from onceflow.store.records import RunRecord
from onceflow.store.runs import flow, keys, runs
from onceflow.store.runs.runs import COLUMNS, Change, EnqueueResult, RunRequest, run_from_row

CANDIDATES = 64
"""The most stale runs one claim cancels before it gives up for this call (the next claim goes on)."""


@attrs.frozen
class Held:
    """Why a claim handed out nothing though runs were eligible: `at_capacity` (an agent's ceiling, scope
    agent with its id, or the global one) or `paused`."""

    reason: Literal["at_capacity", "paused"]
    scope: Literal["agent", "global"] | None = None
    target_id: str | None = None
    max_concurrent: int | None = None


@attrs.frozen
class Claimed:
    """What a claim did: the run it claimed (None: none eligible), the changes on the way (the stale runs
    it cancelled, an expired lease it took over), in how many seconds the agents' next run becomes
    eligible (measured on the clock that judged the claim, store/backends/clock.py; None: no unresolved run of
    the agents is waiting for a time), and why eligible runs were held back (`held`)."""

    run: RunRecord | None
    changes: tuple[Change, ...] = ()
    next_eligible_in: float | None = None
    held: Held | None = None


_ELIGIBLE = (
    "status IN ('queued', 'claimed') AND ((status = 'queued' AND (retry_at IS NULL OR retry_at <= {now}))"
    " OR (status = 'claimed' AND lease_expires_at <= {now}))"
)
_CLASS = {  # the priority class after aging: one class up per aging_s waited, never into 0
    False: "CASE WHEN priority = 0 THEN 0"
    " ELSE MAX(1, priority - CAST(({now} - requested_at) / ?2 AS INTEGER)) END",
    True: "CASE WHEN priority = 0 THEN 0 ELSE GREATEST(1, priority - FLOOR(({now} - requested_at) / ?2)) END",
}
_TURN = "COALESCE((SELECT t.turn FROM run_turns t WHERE t.agent_profile_id = runs.agent_profile_id), 0)"
_CLAIM = (
    "UPDATE runs SET status = 'claimed', claim_token = CAST(attempt + 1 AS TEXT) || '.' || ?1,"
    " attempt = attempt + 1, claimed_at = ?2,"
    " lease_expires_at = ?2 + ?3, wait_seconds = ?3, retry_at = NULL WHERE id = ?4 AND status = 'queued'"
    f" RETURNING {COLUMNS}"
)
"""A claim: its token is `<attempt>.<16 hex>`, the attempt it is minted for (its fence, `_last_claim`) and
random bits (?1)."""


def _candidates(postgres: bool, agents: list[str] | None, skip: int, paused: bool = True) -> str:
    """The claim's candidate query: one eligible run of `agents` (None: any) less `skip` excluded agents,
    not paused (unless `paused` is False), lowest class first, then (across agents) the least recently
    served agent, then the oldest. Parameters: ?1 now (SQLite), ?2 aging_s, then the agents, then the
    excluded ones."""
    now = SERVER_CLOCK if postgres else "?1"
    where = [_ELIGIBLE.format(now=now)]
    n = 3
    if agents is not None:
        marks = ", ".join(f"?{n + i}" for i in range(len(agents)))
        where.append(f"agent_profile_id = ?{n}" if len(agents) == 1 else f"agent_profile_id IN ({marks})")
        n += len(agents)
    if skip:
        where.append(f"agent_profile_id NOT IN ({', '.join(f'?{n + i}' for i in range(skip))})")
    if paused:
        where.append(f"NOT {flow.PAUSED}")
    order = [_CLASS[postgres].format(now=now)]
    if agents is None or len(agents) > 1:
        order.append(_TURN)
    order += ["requested_at", "id"]
    sql = f"SELECT {COLUMNS}, {now} FROM runs WHERE {' AND '.join(where)} ORDER BY {', '.join(order)} LIMIT 1"
    return sql + " FOR UPDATE OF runs SKIP LOCKED" if postgres and paused else sql


def claim(
    conn: Connection, agents: str | list[str] | None, now: float, lease: float, policy: RunPolicy
) -> Claimed:
    """Claim the next eligible run of `agents` (one agent, a list, or None: any) for `lease` seconds
    (module docstring), minting its token. `now` is the runtime's clock; on PostgreSQL the server's clock
    judges instead (store/backends/clock.py).

    Flow control (store/runs/flow.py): agents at their ceiling, or every agent once the global ceiling is
    reached, get nothing (`held` at_capacity); paused runs are skipped (`held` paused when nothing else was
    eligible); the lowest priority class after aging goes first. The ceilings are read (on PostgreSQL
    locked) in this transaction, so every runtime counts the same claims."""
    agent_list = [agents] if isinstance(agents, str) else agents
    postgres = on_postgres(conn)
    changes: list[Change] = []
    ceilings = flow.ceilings(conn, agent_list, now)
    if ceilings.global_full is not None:
        return Claimed(None, (), None, Held("at_capacity", "global", None, ceilings.global_full))
    full = sorted(ceilings.full)
    if agent_list is not None:
        open_agents = [agent for agent in agent_list if agent not in ceilings.full]
        if not open_agents:
            agent = agent_list[0]
            return Claimed(None, (), None, Held("at_capacity", "agent", agent, ceilings.full[agent]))
        agent_list, full = open_agents, []
    candidate = _candidates(postgres, agent_list, len(full))
    args = (now, policy.aging_s, *(agent_list or ()), *full)
    for _ in range(CANDIDATES):
        row = conn.execute(candidate, args).fetchone()
        if row is None:
            held = _held_back(conn, agent_list, ceilings, args, postgres)
            return Claimed(None, tuple(changes), next_eligible(conn, agent_list, now), held)
        run, now = run_from_row(row), float(row[-1])
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
        claimed = conn.execute(_CLAIM, (token, now, lease, run.id)).fetchone()
        if claimed is None:  # another claimer took it between the read and the write (PostgreSQL)
            continue
        record = run_from_row(claimed)
        if agent_list is None or len(agent_list) > 1:
            flow.touch_turn(conn, record.agent_profile_id)
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
    return Claimed(None, tuple(changes), 0.0)


def _held_back(
    conn: Connection,
    agents: list[str] | None,
    ceilings: flow.Ceilings,
    args: tuple[object, ...],
    postgres: bool,
) -> Held | None:
    """Why nothing was claimed though runs may be eligible: one of them belongs to an agent at its ceiling
    (`at_capacity`), or is paused. Only read when the claim found nothing."""
    everyone = None if agents is None else sorted({*agents, *ceilings.full})
    sql = _candidates(postgres, everyone, 0, paused=False)
    row = conn.execute(sql, (*args[:2], *(everyone or ()))).fetchone()
    if row is None:
        return None
    agent = run_from_row(row).agent_profile_id
    if agent in ceilings.full:
        return Held("at_capacity", "agent", agent, ceilings.full[agent])
    return Held("paused")


def next_eligible(conn: Connection, agents: list[str] | None, now: float) -> float | None:
    """In how many seconds (from `now`; on PostgreSQL from the server's clock) the next waiting run of
    `agents` (None: any) becomes eligible (a retry's time, or a lease's end; <= 0: already), or None."""
    where = "status IN ('queued', 'claimed')"
    if agents is not None:
        where += f" AND agent_profile_id IN ({', '.join(f'?{i + 2}' for i in range(len(agents)))})"
    sql = Clocked.of(
        "SELECT MIN(CASE status WHEN 'queued' THEN retry_at ELSE lease_expires_at END) - {now} FROM runs"
        f" WHERE {where}",
        "?1",
    )
    (left,) = conn.execute(sql.on(conn), (now, *(agents or ()))).fetchone()
    return None if left is None else float(left)


@attrs.frozen
class Renewed:
    """A renewal: the run, and its new lease end (Unix seconds)."""

    run: RunRecord
    lease_expires_at: float


_RENEW = Clocked.of(
    "UPDATE runs SET lease_expires_at = {now} + ?2, wait_seconds = ?2"
    " WHERE id = ?3 AND status = 'claimed' AND claim_token = ?4 RETURNING lease_expires_at",
    "?1",
)


def renew(conn: Connection, run_id: int, token: str, now: float, lease: float) -> Renewed:
    """Extend the claim's lease to `lease` seconds from now (`now`; on PostgreSQL the server's clock).

    Raises:
        NotFoundError: no run `run_id` (field run_id).
        ConflictError: `token` is not the run's current claim (field claim_token), also when another
            runtime's transaction ended the claim between the read and the write (PostgreSQL).
    """
    held = _held(conn, run_id, token)
    renewed = conn.execute(_RENEW.on(conn), (now, lease, run_id, token)).fetchone()
    if renewed is None:
        raise ConflictError(f"run {run_id} changed meanwhile", field="claim_token")
    return Renewed(held, float(renewed[0]))


def requeue(conn: Connection, run_id: int, token: str) -> RunRecord:
    """Hand the claim under `token` back (`requeue_run`): queued again in its place in line (its request
    time and priority unchanged), the attempt counted, outcome_reason `requeued`.

    Raises:
        NotFoundError: no run `run_id` (field run_id).
        ConflictError: `token` is not its current claim (field claim_token).
    """
    _held(conn, run_id, token)
    row = conn.execute(
        "UPDATE runs SET status = 'queued', claim_token = NULL, lease_expires_at = NULL, wait_seconds = NULL,"
        " outcome_reason = 'requeued' WHERE id = ? AND status = 'claimed' AND claim_token = ?"
        f" RETURNING {COLUMNS}",
        (run_id, token),
    ).fetchone()
    if row is None:  # another runtime's transaction ended the claim after the read (PostgreSQL)
        raise ConflictError(f"run {run_id} changed meanwhile", field="claim_token")
    return run_from_row(row)


def retry(conn: Connection, run_id: int, now: float) -> RunRecord:
    """Queue a fresh run for the failed or cancelled run `run_id` (`retry_run`): its agent, task, step,
    reason and payload, priority at most 1 (recovery), in its causation chain (its parent's child, as it
    was), `retry_of` naming it. An operator's retry passes the flow limits (no `max_depth`, and the chain
    keeps its human root or not as it was). Returns the new run, read in the same transaction.

    Raises:
        NotFoundError: no run `run_id` (field run_id).
        ConflictError: it is not failed or cancelled (field run_id).
    """
    run = runs.get_run(conn, run_id)
    if run is None:
        raise NotFoundError(f"run {run_id} does not exist", field="run_id")
    if run.status not in ("failed", "cancelled"):
        raise ConflictError(
            f"run {run_id} is {run.status}: only a failed or cancelled run is retried", field="run_id"
        )
    request = RunRequest(
        agent_profile_id=run.agent_profile_id,
        task_id=run.task_id,
        step_id=run.step_id,
        reason=run.reason,
        payload=run.payload,
        exclude_from_coalescing=True,
        trigger="retry_run",
        priority=min(run.priority, 1),
        cause=flow.Cause(run.parent_run_id, human=run.human_rooted, max_depth=None, exempt=True),
        retry_of=run.id,
    )
    queued = runs.get_run(conn, runs.enqueue_run(conn, request, now).run_id)
    assert queued is not None  # key-less, never coalesced, exempt from the limits: always inserted
    return queued


def store_result(conn: Connection, run_id: int, result: object) -> None:
    """Keep `result` (JSON) as the run's result."""
    encoded = runs.payload_json(result)  # type: ignore[arg-type]
    conn.execute("UPDATE runs SET result = ? WHERE id = ?", (encoded, run_id))


def release(conn: Connection, run_id: int, token: str) -> bool:
    """Hand back the claim under `token` as if it never happened (its caller was cancelled before it saw
    it): queued again, the attempt not counted. False when the claim already ended."""
    return (
        conn.execute(
            "UPDATE runs SET status = 'queued', claim_token = NULL, attempt = attempt - 1,"
            " lease_expires_at = NULL, wait_seconds = NULL, outcome_reason = 'claim_released'"
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
    return _check_held(run, token)


def _check_held(run: RunRecord, token: str) -> RunRecord:
    if run.status != "claimed" or run.claim_token != token:
        why = "claimed under another token" if run.status == "claimed" else run.status
        raise ConflictError(
            f"run {run.id} is not claimed under this token (it is {why})", field="claim_token"
        )
    return run


_LOCKED = Clocked.of("SELECT " + COLUMNS + ", {now} FROM runs WHERE id = ?1", "?2")
_LOCKED_PG = _LOCKED.postgres + " FOR UPDATE"


def _locked(conn: Connection, run_id: int, now: float) -> tuple[RunRecord, float]:
    """The run, and the time its change is judged at (`now`; on PostgreSQL the server's clock). On
    PostgreSQL the row stays locked to the end of the transaction, so a finish racing another runtime's
    waits for it and then reads what it committed (an identical finish is then a replay, not a lost
    compare-and-set).

    Raises:
        NotFoundError: no run `run_id` (field run_id).
    """
    row = conn.execute(_LOCKED_PG if on_postgres(conn) else _LOCKED.sqlite, (run_id, now)).fetchone()
    if row is None:
        raise NotFoundError(f"run {run_id} does not exist", field="run_id")
    return run_from_row(row), float(row[-1])


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
    unfenced: bool = False,
    result: object = None,
) -> Finished:
    """`_finish`, then the host's `result` kept with the run (not on a replay)."""
    done = _finish(
        conn,
        run_id,
        token,
        status,
        error=error,
        retryable=retryable,
        retry_at=retry_at,
        now=now,
        policy=policy,
        draw=draw,
        unfenced=unfenced,
    )
    if result is not None and not done.replay:
        store_result(conn, run_id, result)
        done = attrs.evolve(done, run=attrs.evolve(done.run, result=result))
    return done


def _finish(
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
    unfenced: bool = False,
) -> Finished:
    """Resolve the attempt under `token`. Without a token the finish is refused unless `unfenced` (the
    host's explicit opt-out: it resolves a claimed run's current claim, whoever holds it). `draw` in [0, 1)
    picks the jitter of a retry's backoff. Judged at `now` (on PostgreSQL the server's clock), with the
    run's row locked, so the same finish sent twice at once is one finish and one replay.

    Raises:
        NotFoundError: no run `run_id`, or (without a token) it is not claimed (field run_id).
        FenceRequiredError: no token and not `unfenced`, for a claimed run (field claim_token).
        ConflictError: `token` is not its current claim, or the same claim's finish recorded another
            outcome (field claim_token / status).
    """
    run, now = _locked(conn, run_id, now)
    if token is None and run.status != "claimed":
        raise NotFoundError(f"no claimed run {run_id}", field="run_id")
    if token is None and not unfenced:
        raise FenceRequiredError(
            f"run {run_id} is claimed: finish it with its claim_token (or send unfenced: true to resolve"
            " whichever claim holds it)",
            field="claim_token",
        )
    token = run.claim_token if token is None else token
    if run.status != "claimed" and token is not None and _last_claim(run, token):
        if _same_outcome(run, status):
            return Finished(run, True, ())
        raise ConflictError(f"run {run_id}'s claim already ended ({run.status})", field="status")
    held = _check_held(run, token or "")
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
        "UPDATE runs SET status = 'queued', retries = retries + 1, retry_at = ?1, wait_seconds = ?2,"
        f" lease_expires_at = NULL, last_error = ?3, outcome_reason = 'retry_scheduled', {_FENCE_KEPT}"
        f" WHERE id = ?4 AND status = 'claimed' AND claim_token = ?5 RETURNING {COLUMNS}",
        (when, max(when - now, 0.0), error, run_id, token),
    ).fetchone()
    if queued is None:  # another runtime's transaction ended the claim after the read (PostgreSQL)
        raise ConflictError(f"run {run_id} changed meanwhile", field="claim_token")
    return _ended(run_from_row(queued), "retry_scheduled", "retry_scheduled")


_FENCE_KEPT_VALUE = "CASE WHEN claim_token LIKE '%.%' THEN '' ELSE claim_token END"
_FENCE_KEPT = f"claim_token = {_FENCE_KEPT_VALUE}"
"""What a claim's end by its finish leaves of its token: '' when it carries its fence (`_CLAIM`), since the
run's `attempt` is that fence; a token minted before them is kept whole."""


def _last_claim(run: RunRecord, token: str) -> bool:
    """Whether `token` is the claim whose finish ended `run` (not claimed now), so the same finish again is a
    replay: the token itself while the run keeps it; once its finish left '' (`_FENCE_KEPT`), the attempt the
    token was minted for against the run's. Every claim of an attempt but the last was released by onceflow
    before a host saw its token (`release`), so a host's token from an earlier claim is stale either way."""
    if run.claim_token != "":
        return run.claim_token == token
    fence, dot, _ = token.partition(".")
    return dot == "." and fence == str(run.attempt)


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
        "UPDATE runs SET status = ?, finished_at = ?, lease_expires_at = NULL, wait_seconds = NULL,"
        " outcome_reason = ?, last_error = COALESCE(?, last_error),"
        f" claim_token = CASE WHEN status = 'claimed' THEN {_FENCE_KEPT_VALUE} ELSE claim_token END"
        f" WHERE id = ? AND status = ? AND COALESCE(claim_token, '') = ? RETURNING {COLUMNS}",
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
            priority=1,
            cause=flow.Cause(failed.id, max_depth=None),
        )
        queued = runs.enqueue_run(conn, request, now)
        refused = queued.refusal
        changes.append(
            Change(
                "escalated",
                queued.run_id,
                failed.task_id,
                ceo,
                0,
                queued.outcome,
                failed.step_id,
                error=None if refused is None else refused.limit,
                retries=0 if refused is None else refused.value,
            )
        )
    return changes


def _cancel(conn: Connection, run: RunRecord, reason: str, now: float) -> bool:
    """Cancel an unresolved run (compare-and-set on its status); False when it was resolved meanwhile. A
    claimed run's token goes: its holder's finish is then a conflict, never a replay (a kept token means
    the holder's own finish ended the claim)."""
    return (
        conn.execute(
            "UPDATE runs SET status = 'cancelled', outcome_reason = ?, finished_at = ?,"
            " lease_expires_at = NULL, wait_seconds = NULL,"
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
    run, now = _locked(conn, run_id, now)
    if run.status == "cancelled":
        return False, None
    if run.status not in runs.UNRESOLVED or not _cancel(conn, run, reason, now):
        raise ConflictError(f"run {run_id} is {run.status}: it cannot be cancelled", field="run_id")
    return True, Change("cancelled", run.id, run.task_id, run.agent_profile_id, run.attempt, reason)


@attrs.frozen
class Expired:
    """What a lease sweep did, and in how many seconds the next lease held now ends (on the clock that judged
    the sweep, store/backends/clock.py; None: none is held)."""

    changes: list[Change]
    next_in: float | None


def expire_leases(conn: Connection, now: float, limit: int, policy: RunPolicy) -> Expired:
    """Return to the queue (or end) up to `limit` claimed runs whose lease expired: queued again, their
    attempt used (`lease_expired`); cancelled when their entry was left meanwhile (`entry_left`) or they are
    past the age limit (`run_too_old`); failed once they had `max_attempts` claims. Judged at `now` (on
    PostgreSQL the server's clock, read once); first every lease ending further ahead than its own length is
    cut to end then (store/backends/clock.py `clamp_leases`: a lease written under a clock that stepped
    back)."""
    now = judge(conn, now)
    clamp_leases(conn, now)
    rows = conn.execute(
        f"SELECT {COLUMNS} FROM runs WHERE status = 'claimed' AND lease_expires_at <= ?1"
        " ORDER BY lease_expires_at LIMIT ?2",
        (now, limit),
    ).fetchall()
    changes = [change for run in map(run_from_row, rows) for change in _expired(conn, run, now, policy)]
    (next_in,) = conn.execute(
        "SELECT MIN(lease_expires_at) - ? FROM runs WHERE status = 'claimed'", (now,)
    ).fetchone()
    return Expired(changes, None if next_in is None else float(next_in))


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
        "UPDATE runs SET status = 'queued', lease_expires_at = NULL, wait_seconds = NULL, claim_token = NULL,"
        " outcome_reason = 'lease_expired' WHERE id = ? AND status = 'claimed' AND claim_token = ?",
        (run.id, run.claim_token),
    ).rowcount
    return (
        [Change("lease_expired", run.id, run.task_id, run.agent_profile_id, run.attempt)] if requeued else []
    )


_CANCEL_TASK = Clocked.of(
    "UPDATE runs SET status = 'cancelled', outcome_reason = 'task_deleted', finished_at = {now},"
    " lease_expires_at = NULL, wait_seconds = NULL WHERE task_id = ?2 AND status IN ('queued', 'claimed')"
    " RETURNING id, agent_profile_id, attempt",
    "?1",
)


def cancel_task_runs(conn: Connection, task_id: str, now: float) -> list[Change]:
    """Cancel every queued or claimed run of the task (it is being deleted: `task_deleted`), stamped `now`
    (on PostgreSQL the server's clock)."""
    rows = conn.execute(_CANCEL_TASK.on(conn), (now, task_id)).fetchall()
    return [
        Change("cancelled", run_id, task_id, agent, attempt, "task_deleted")
        for run_id, agent, attempt in rows
    ]
