"""Publishing what a committed action did: its events, its diagnostics, then its `action_outcome`. Trio
thread: called after the transaction that applied the action has committed, never from the writer."""

from __future__ import annotations

from collections.abc import Iterable

from onceflow.actors.kernel.outbox import Outbox
from onceflow.protocol import trusted
from onceflow.protocol.events import (
    RunCancelled,
    RunClaimed,
    RunFailed,
    RunFinished,
    RunLeaseExpired,
    RunQueued,
    RunRateLimited,
    RunRequeued,
    RunRetryScheduled,
)
from onceflow.protocol.times import rfc3339
from onceflow.store.entries.executors import DiagnosticNote, Effect
from onceflow.store.runs import keys
from onceflow.store.runs.runs import Change


def publish_effect(
    out: Outbox,
    effect: Effect,
    *,
    task_id: str,
    step_id: str,
    trigger: str,
    position: int,
    kind: str,
    failure: DiagnosticNote | None = None,
) -> None:
    """Publish a committed action's events and diagnostics, its `failure` record when it failed, then its
    `action_outcome` event (in that order)."""
    for event in effect.events:
        out.emit(event)
    for note in effect.diagnostics:
        out.diagnostic(note.level, note.code, **note.fields)
    if effect.state == "failed" and failure is not None:
        out.diagnostic(failure.level, failure.code, **failure.fields)
    outcome = trusted.action_outcome(  # the runtime's own typed values: unvalidated
        task_id=task_id,
        step_id=step_id,
        trigger=trigger,
        position=position,
        kind=kind,
        outcome=effect.state,
        detail=effect.detail,
    )
    out.emit(outcome)


def publish_run_changes(out: Outbox, changes: Iterable[Change]) -> None:
    """Publish what a committed transaction did to runs (`store.runs.Change`), one event per change: a
    cancellation, an expired lease, a claim, a finish, a scheduled retry, a final failure (with the run it
    escalated to, if any) and that escalation's enqueue; a claimed run whose entry was left stays claimed
    and gets an INFO `run_superseded` diagnostic (its holder learns it from `renew_run`/`finish_run`)."""
    pending = list(changes)
    for index, change in enumerate(pending):
        run_id, task_id, agent, attempt = (
            change.run_id,
            change.task_id,
            change.agent_profile_id,
            change.attempt,
        )
        match change.kind:
            case "cancelled":
                out.emit(
                    RunCancelled(
                        run_id=run_id,
                        task_id=task_id,
                        agent_profile_id=agent,
                        attempt=attempt,
                        reason=change.reason,
                    )
                )
            case "superseded":
                out.diagnostic(
                    "info",
                    "run_superseded",
                    run_id=run_id,
                    task_id=task_id,
                    agent_profile_id=agent,
                    reason=change.reason,
                )
            case "lease_expired":
                out.emit(
                    RunLeaseExpired(run_id=run_id, task_id=task_id, agent_profile_id=agent, attempt=attempt)
                )
            case "claimed":
                assert change.lease_expires_at is not None
                out.emit(
                    RunClaimed(
                        run_id=run_id,
                        task_id=task_id,
                        agent_profile_id=agent,
                        attempt=attempt,
                        lease_expires_at=rfc3339(change.lease_expires_at),
                    )
                )
            case "finished":
                out.emit(
                    RunFinished(
                        run_id=run_id,
                        task_id=task_id,
                        agent_profile_id=agent,
                        attempt=attempt,
                        superseded=change.superseded,
                    )
                )
            case "retry_scheduled":
                assert change.retry_at is not None
                out.emit(
                    RunRetryScheduled(
                        run_id=run_id,
                        task_id=task_id,
                        agent_profile_id=agent,
                        attempt=attempt,
                        retry_at=rfc3339(change.retry_at),
                        retries=change.retries,
                        error=change.error,
                    )
                )
            case "failed":
                after = pending[index + 1] if index + 1 < len(pending) else None
                escalated = after is not None and after.kind == "escalated" and after.reason == "queued"
                out.emit(
                    RunFailed(
                        run_id=run_id,
                        task_id=task_id,
                        agent_profile_id=agent,
                        attempt=attempt,
                        reason=change.reason,
                        error=change.error,
                        escalated_run_id=after.run_id if escalated and after else None,
                    )
                )
            case "escalated" if change.reason == "queued":
                out.emit(
                    RunQueued(
                        run_id=run_id,
                        task_id=task_id,
                        step_id=change.step_id,
                        agent_profile_id=agent,
                        reason="agent_error",
                        idempotency_key=keys.escalation_key(pending[index - 1].run_id),
                        priority=1,
                        parent_run_id=pending[index - 1].run_id,
                    )
                )
            case "escalated" if change.reason == "rate_limited":
                out.emit(
                    RunRateLimited(
                        run_id=run_id,
                        task_id=task_id,
                        agent_profile_id=agent,
                        reason="agent_error",
                        limit=change.error or "",
                        limit_value=change.retries,
                        parent_run_id=pending[index - 1].run_id,
                        causation_depth=0,
                    )
                )
            case "requeued":
                out.emit(RunRequeued(run_id=run_id, task_id=task_id, agent_profile_id=agent, attempt=attempt))
