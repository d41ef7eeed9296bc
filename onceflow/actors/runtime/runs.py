"""The runs queue's commands (claim with a long poll, renew, finish, cancel) and the lease sweep. Trio
thread: each command is one store transaction (store/runs/run_claims.py decides), whose changes are published
as events once it committed (actors/engine/publish.py).

A waiting claim (`wait_seconds`) sleeps on the agent's wake-up (actors/kernel/run_signals.py) until a run
of the agent is queued or a lease of it expires in this runtime, until the next retry or lease end it was
told of, or (PostgreSQL, where other runtimes queue runs too) for at most `PG_POLL` seconds, then looks
again: no busy polling. A claim whose caller is cancelled once it committed is released (queued again,
its attempt not counted), so a cancelled wait claims nothing.
"""

from __future__ import annotations

import math
import random

import trio
from trio.lowlevel import enable_ki_protection

from onceflow.actors.engine.publish import publish_run_changes
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.kernel.run_signals import ANY
from onceflow.actors.kernel.services import Services
from onceflow.observability.logs import get_logger
from onceflow.protocol import commands as c
from onceflow.protocol.errors import NotFoundError, ProtocolError
from onceflow.protocol.events import RunClaimHeld, RunQueued
from onceflow.protocol.results import (
    ClaimedRun,
    FinishOutcome,
    RunCancelledResult,
    RunInfo,
    RunRenewed,
    RunRequeued,
    RunRetried,
)
from onceflow.protocol.times import rfc3339, rfc3339_or_none
from onceflow.store.runs import run_claims, runs
from onceflow.store.runs.runs import Change

log = get_logger("onceflow.runs")

PG_POLL = 1.0
"""Seconds a waiting claim on PostgreSQL sleeps at most between two looks (another runtime's enqueue
wakes nobody here)."""

LEASE_SWEEP_INTERVAL = 5.0
"""On PostgreSQL, the most seconds between two sweeps of expired leases (other runtimes grant leases this
one is not told of; `open_runtime(lease_sweep_interval=...)`). On SQLite a sweep comes when a lease ends."""

SWEEP_LIMIT = 500
"""The most expired leases one sweep ends (the next takes the rest)."""


def lease_for(services: Services, lease_seconds: float | None) -> float:
    """The lease a claim or renewal gets: `lease_seconds`, else the policy's default.

    Raises:
        ProtocolError: `lease_seconds` exceeds the policy's `max_lease` (field lease_seconds).
    """
    policy = services.run_policy
    if lease_seconds is None:
        return policy.lease
    if lease_seconds > policy.max_lease:
        raise ProtocolError(
            f"lease_seconds must be at most {policy.max_lease:g} s, got {lease_seconds:g}",
            field="lease_seconds",
        )
    return lease_seconds


async def claim(services: Services, command: c.ClaimRun, out: Outbox) -> ClaimedRun | None:
    """`claim_run`: the next eligible run of the agent (of the agents, of any agent), claimed under a new
    token, or None once `command.wait_seconds` passed with none eligible (module docstring); a None held
    back by flow control carries a `run_claim_held` event in the reply (never broadcast). A cancellation
    leaves nothing claimed: a claim it interrupts after the commit is released."""
    lease = lease_for(services, command.lease_seconds)
    agents = command.agents()
    target: str | list[str] | None = agents[0] if agents is not None and len(agents) == 1 else agents
    agent = target if isinstance(target, str) else ANY
    signals = services.run_signals
    deadline = trio.current_time() + command.wait_seconds
    with signals.waiting(agent):
        while True:
            woken = signals.current(agent)  # before the look: a run queued after it began still wakes us
            asked = trio.current_time()
            found = await services.store.transact(
                run_claims.claim, target, services.now(), lease, services.run_policy
            )
            try:
                await trio.lowlevel.checkpoint_if_cancelled()
            except trio.Cancelled:
                if found.run is not None:
                    await _release(services, found.run.id, found.run.claim_token or "")
                    found = run_claims.Claimed(None, found.changes[:-1])
                publish_run_changes(out, found.changes)
                raise
            publish_run_changes(out, found.changes)
            if found.run is not None:
                assert found.run.claim_token is not None
                return ClaimedRun(**runs.run_info(found.run), claim_token=found.run.claim_token)
            left = deadline - trio.current_time()
            if left <= 0:
                if found.held is not None:
                    out.note(_held_event(found.held))
                return None
            if found.next_eligible_in is not None:  # measured from the look: less the time since
                left = min(left, max(found.next_eligible_in - (trio.current_time() - asked), 0.0))
            if services.store.postgres:
                left = min(left, PG_POLL)
            with trio.move_on_after(left):
                await woken.wait()


def _held_event(held: run_claims.Held) -> RunClaimHeld:
    return RunClaimHeld(
        reason=held.reason,
        limit_scope=held.scope,
        limit_id=held.target_id,
        max_concurrent=held.max_concurrent,
    )


async def _release(services: Services, run_id: int, token: str) -> None:
    """Hand back a claim its caller will never see (it was cancelled once the claim committed)."""
    with trio.CancelScope(shield=True):
        try:
            await services.store.transact(run_claims.release, run_id, token)
        except Exception as exc:  # the lease still ends it: the run is handed out again then
            log.warning("run_release_failed", run_id=run_id, cause=repr(exc))
        else:
            log.info("run_claim_released", run_id=run_id)


async def renew(services: Services, command: c.RenewRun) -> RunRenewed:
    """`renew_run`: extend the lease of the claim under `claim_token` (store/runs/run_claims.py `renew`).

    Raises:
        ProtocolError: `lease_seconds` above the policy's `max_lease` (field lease_seconds).
        NotFoundError / ConflictError: as `run_claims.renew` (run_id / claim_token); nothing changes.
    """
    lease = lease_for(services, command.lease_seconds)
    renewed = await services.store.transact(
        run_claims.renew, command.run_id, command.claim_token, services.now(), lease
    )
    return RunRenewed(
        run_id=command.run_id,
        lease_expires_at=rfc3339(renewed.lease_expires_at),
        superseded=renewed.run.superseded,
    )


async def finish(services: Services, command: c.FinishRun, out: Outbox) -> FinishOutcome:
    """`finish_run`: resolve the attempt under `claim_token` (store/runs/run_claims.py `finish`), publishing
    what it changed; a replay publishes nothing.

    Raises:
        NotFoundError / FenceRequiredError / ConflictError: as `run_claims.finish` (run_id / claim_token
            / status); nothing changes.
    """
    done = await services.store.transact(
        run_claims.finish,
        command.run_id,
        command.claim_token,
        command.status,
        error=command.error,
        retryable=command.retryable,
        retry_at=command.retry_at,
        now=services.now(),
        policy=services.run_policy,
        draw=random.random(),
        unfenced=command.unfenced,
        result=command.result,
    )
    publish_run_changes(out, done.changes)
    run = done.run
    return FinishOutcome(
        run_id=run.id,
        status=run.status,
        retry_at=rfc3339_or_none(run.retry_at) if run.status == "queued" else None,
        superseded=run.superseded,
        replay=done.replay,
        escalated_run_id=None if done.escalation is None else done.escalation.run_id,
    )


async def cancel(services: Services, command: c.CancelRun, out: Outbox) -> RunCancelledResult:
    """`cancel_run`: cancel a queued or claimed run (store/runs/run_claims.py `cancel`).

    Raises:
        NotFoundError / ConflictError: as `run_claims.cancel` (field run_id).
    """
    cancelled, change = await services.store.transact(
        run_claims.cancel, command.run_id, command.reason, services.now()
    )
    if change is not None:
        publish_run_changes(out, (change,))
    return RunCancelledResult(run_id=command.run_id, cancelled=cancelled)


async def requeue(services: Services, command: c.RequeueRun, out: Outbox) -> RunRequeued:
    """`requeue_run`: hand the claim under `claim_token` back to the queue (store/runs/run_claims.py
    `requeue`).

    Raises:
        NotFoundError / ConflictError: as `run_claims.requeue` (run_id / claim_token); nothing changes.
    """
    run = await services.store.transact(run_claims.requeue, command.run_id, command.claim_token)
    change = Change("requeued", run.id, run.task_id, run.agent_profile_id, run.attempt)
    publish_run_changes(out, (change,))
    return RunRequeued(run_id=run.id, status="queued")


async def retry(services: Services, command: c.RetryRun, out: Outbox) -> RunRetried:
    """`retry_run`: a fresh run for a failed or cancelled one (store/runs/run_claims.py `retry`),
    `run_queued`.

    Raises:
        NotFoundError / ConflictError: as `run_claims.retry` (run_id); nothing changes.
    """
    run = await services.store.transact(run_claims.retry, command.run_id, services.now())
    out.emit(
        RunQueued(
            run_id=run.id,
            task_id=run.task_id,
            step_id=run.step_id,
            agent_profile_id=run.agent_profile_id,
            reason=run.reason,
            idempotency_key=None,
            priority=run.priority,
            parent_run_id=run.parent_run_id,
            causation_depth=run.causation_depth,
        )
    )
    return RunRetried(run_id=run.id, retry_of=command.run_id)


async def get(services: Services, command: c.GetRun) -> RunInfo:
    """`get_run`: the run as `list_runs` shows it.

    Raises:
        NotFoundError: no run `run_id` (field run_id).
    """
    run = await services.store.transact(runs.get_run, command.run_id)
    if run is None:
        raise NotFoundError(f"run {command.run_id} does not exist", field="run_id")
    return runs.run_info(run)


async def sweep_leases_once(services: Services, hub: EventHub) -> run_claims.Expired:
    """End up to `SWEEP_LIMIT` expired leases (store/runs/run_claims.py `expire_leases`), publishing each
    change. Never raises: a failure is logged at WARNING (and the next sweep comes `LEASE_SWEEP_INTERVAL`
    seconds later)."""
    try:
        expired = await services.store.transact(
            run_claims.expire_leases, services.now(), SWEEP_LIMIT, services.run_policy
        )
    except Exception as exc:
        log.warning("lease_sweep_failed", cause=repr(exc))
        return run_claims.Expired([], LEASE_SWEEP_INTERVAL)
    publish_run_changes(Outbox(hub, reply=False), expired.changes)
    return expired


@enable_ki_protection
async def sweep_leases_forever(
    services: Services,
    hub: EventHub,
    interval: float = LEASE_SWEEP_INTERVAL,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Sweep expired leases (`sweep_leases_once`) at once, then whenever the next lease ends (a claim in
    this runtime wakes it to look again); on PostgreSQL also every `interval` seconds, since other
    runtimes grant leases too. With no lease held it sleeps, holding no timer. `start` it to get the cancel
    scope that stops it. Leases are durable times, so a dead runtime's leases end on whichever runtime
    sweeps first, and a restarted one's at its first sweep (at most their own length after it: each sweep
    first cuts a lease ending further ahead, store/backends/clock.py). The waits are Trio's monotonic time,
    measured from each sweep's look."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            woken = services.run_signals.leased
            asked = trio.current_time()
            expired = await sweep_leases_once(services, hub)
            if len(expired.changes) >= SWEEP_LIMIT:
                await trio.sleep(0)
                continue
            elapsed = trio.current_time() - asked  # `next_in` is measured from the sweep's look
            wait = math.inf if expired.next_in is None else max(expired.next_in - elapsed, 0.0)
            if services.store.postgres:
                wait = min(wait, interval)
            with trio.move_on_after(wait):
                await woken.wait()
