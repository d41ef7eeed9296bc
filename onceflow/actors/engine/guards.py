"""Guarded transitions: which step a transition action moves to, and whether its quorum guard lets it.
Trio thread: one store read of the task's seats and decisions, then the pure rules of `quorum`.
Source: kandev-engine-notes.md, "Trigger handling" and "Quorum guards".
"""

from __future__ import annotations

from onceflow.actors.engine.quorum import evaluate_quorum, parse_threshold
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.kernel.services import Services
from onceflow.protocol.events import GuardEvaluated
from onceflow.protocol.workflow import ActionDecl, Step, Workflow
from onceflow.store.entries import participants
from onceflow.store.records import TaskRecord


async def evaluate_transition(
    services: Services, task: TaskRecord, workflow: Workflow, step: Step, action: ActionDecl, out: Outbox
) -> Step | None:
    """The step transition `action` of `step` moves `task` to, or None: requires_approval, no such step
    (the last step's move_to_next), or a `wait_for_quorum` guard not satisfied. A guard's evaluation is
    emitted as `guard_evaluated`. Raises what the store read raises (a `StorageError`)."""
    config = action.config
    if getattr(config, "requires_approval", False):
        return None
    if action.type == "move_to_next":
        target = workflow.next_step(step.id)
    elif action.type == "move_to_previous":
        target = workflow.previous_step(step.id)
    else:
        target = workflow.step(getattr(config, "step_id", ""))
    guard = getattr(config, "guard", None)
    if target is None or guard is None:
        return target
    rows, decisions = await services.store.transact(
        participants.seats_and_decisions, workflow_id=task.workflow_id, task_id=task.id, step_id=step.id
    )
    quorum = evaluate_quorum(
        threshold=parse_threshold(guard.threshold),
        role=guard.role,
        task_id=task.id,
        step_id=step.id,
        participants=rows,
        decisions=decisions,
    )
    out.emit(
        GuardEvaluated(
            task_id=task.id,
            step_id=step.id,
            target_step=target.id,
            role=guard.role,
            threshold=guard.threshold,
            satisfied=quorum.satisfied,
            seats=quorum.seats,
            approvals=quorum.approvals,
            reason=quorum.reason,
        )
    )
    return target if quorum.satisfied else None
