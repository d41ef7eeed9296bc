"""A reviewer's or approver's decision on a task: record it, say whether it counted, re-evaluate the step's
quorum guards. Trio thread."""

from __future__ import annotations

from onceflow.actors.engine.decisions import QUORUM_RULES, quorum_guards
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.task.context import TaskContext
from onceflow.protocol import commands as c
from onceflow.protocol.events import DecisionRecorded
from onceflow.protocol.operation_ids import decision_operation_id
from onceflow.protocol.results import AlreadyApplied, DecisionResult, GuardOutcome
from onceflow.store.entries import decisions
from onceflow.store.records import TaskRecord


async def record_decision(
    ctx: TaskContext, command: c.RecordDecision, out: Outbox
) -> DecisionResult | AlreadyApplied:
    """Record a decision and apply the first satisfied guarded transition of its step.

    In-process redeliveries are stopped by the ledger (`decision:<task>:<step>:<id>`, marked after the
    in-call commit: AC-EO-9); across restarts the durable receipt recognises a redelivered vote while
    retention keeps it, and the guards are simply re-evaluated; a vote naming its round (`entry_seq`)
    never counts outside it, whatever was pruned (store/entries/decisions.py). A reused `decision_id` with
    other content is a ConflictError in both cases.

    The reply says whether the vote counted (`counted`, `not_counted_reason`; a WARNING
    `decision_not_counted` diagnostic when it did not) and what the guards did (`guard_outcome`: moved,
    quorum_not_met, move_abandoned, no_guard, or not_at_step when the task is not at the decision's step:
    nothing is evaluated).
    """
    task_id = ctx.task_id
    op = decision_operation_id(task_id, command.step_id, command.decision_id) if command.decision_id else ""
    ledger, services = ctx.services.ledger, ctx.services
    applied = bool(op) and await ledger.is_applied(op)
    recorded = await ctx.store.transact(
        decisions.record, command, services.workflows.pinned, QUORUM_RULES, services.now()
    )
    if applied and not recorded.inserted:
        return AlreadyApplied(idempotent=True, operation_id=op)
    if recorded.inserted:
        assert recorded.decision_id is not None
        out.emit(
            DecisionRecorded(
                decision_id=recorded.decision_id,
                task_id=task_id,
                step_id=command.step_id,
                decider_id=command.decider_id,
                decision=command.decision,
                role=recorded.role or "",
            )
        )
    if recorded.not_counted is not None:
        out.diagnostic(
            "warning",
            "decision_not_counted",
            task_id=task_id,
            step_id=command.step_id,
            decision_id=recorded.decision_id,
            decider_type=command.decider_type,
            decider_id=command.decider_id,
            participant_id=command.participant_id,
            role=recorded.role,
            entry_seq=command.entry_seq,
            reason=recorded.not_counted,
        )
    # Re-evaluated on a replay too: a redelivery may follow a first delivery whose transition failed.
    moved_to: str | None = None
    guard_outcome: GuardOutcome = "not_at_step"
    if recorded.task.step_id == command.step_id:
        moved_to, guard_outcome = await _reevaluate(ctx, recorded.task, op, out)
    if op:
        await ledger.mark_applied(op)
    counted = recorded.not_counted is None if recorded.inserted else None
    if recorded.decision_id is None:  # a vote for a round that is over: said not counted, never silently
        counted = False
    return DecisionResult(
        decision_id=recorded.decision_id,
        recorded=recorded.inserted,
        role=recorded.role,
        counted=counted,
        not_counted_reason=recorded.not_counted,
        moved_to=moved_to,
        guard_outcome=guard_outcome,
        operation_id=op or None,
    )


async def _reevaluate(
    ctx: TaskContext, task: TaskRecord, op: str, out: Outbox
) -> tuple[str | None, GuardOutcome]:
    """Apply the first satisfied guarded on_turn_complete transition of the task's step (`op`: the
    decision's operation id, "" for none, named by the transition in the task's history).

    Returns (the step moved to, or None; the outcome). The move is a compare-and-set on the task still
    being at its step; a lost race is `move_abandoned` (with a `transition_abandoned` diagnostic),
    distinct from `quorum_not_met` (kandev-engine-notes.md, "Quorum guards").
    """
    workflow = ctx.services.workflows.for_task(task)
    if not workflow.has_step(task.step_id):  # a template re-registered without it: nothing to evaluate
        return None, "no_guard"
    step = workflow.step(task.step_id)
    guarded = quorum_guards(step)
    if not guarded:
        return None, "no_guard"
    for guard in guarded:
        target = await ctx.engine.evaluate_transition(task, workflow, step, guard.action, out)
        if target is not None:
            moved = await ctx.engine.enter_step(
                task, workflow, target, path="E1", trigger="record_decision", out=out, operation_id=op
            )
            return (target.id, "moved") if moved else (None, "move_abandoned")
    return None, "quorum_not_met"
