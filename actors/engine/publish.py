"""Publishing what a committed action did: its events, its diagnostics, then its `action_outcome`. Trio
thread: called after the transaction that applied the action has committed, never from the writer."""

from __future__ import annotations

from onceflow.actors.kernel.outbox import Outbox
from onceflow.protocol import trusted
from onceflow.store.executors import DiagnosticNote, Effect


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
