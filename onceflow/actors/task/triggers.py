"""A task's triggers: turn start and complete, and the event triggers (comments, blockers, children,
approvals, agent errors, heartbeats, budget alerts). Trio thread.

Agent errors and children-completed are evaluated first and committed here, then marked, under a
per-operation-id lock (evaluate-only-operation-marking.md AC-EO-10 ... AC-EO-17).
"""

from __future__ import annotations

import attrs

from onceflow.actors.engine import children
from onceflow.actors.engine.triggers import HandleInput, HandleResult
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.task.context import TaskContext
from onceflow.protocol import commands as c
from onceflow.protocol.errors import StorageError
from onceflow.protocol.operation_ids import operation_id
from onceflow.protocol.results import (
    AlreadyApplied,
    ChildrenCompletedResult,
    ChildrenNotTerminal,
    OpenChild,
    TriggerResult,
)
from onceflow.protocol.workflow import Trigger, find_step
from onceflow.store.tasks import tasks

EVENT_TRIGGERS: dict[type[c.EventTrigger], Trigger] = {
    c.TaskComment: Trigger.on_comment,
    c.BlockersResolved: Trigger.on_blocker_resolved,
    c.ChildrenCompleted: Trigger.on_children_completed,
    c.ApprovalResolved: Trigger.on_approval_resolved,
    c.AgentError: Trigger.on_agent_error,
    c.Heartbeat: Trigger.on_heartbeat,
    c.BudgetAlert: Trigger.on_budget_alert,
}
"""The trigger each event command fires."""


def _trigger_result(
    result: HandleResult, operation: str | None, *, applied: bool | None = None
) -> TriggerResult:
    return TriggerResult(
        idempotent=result.idempotent,
        from_step=result.from_step,
        to_step=result.to_step,
        transitioned=result.transitioned,
        applied=result.applied if applied is None else applied,
        operation_mark_deferred=result.operation_mark_deferred,
        operation_id=operation,
    )


async def trigger(ctx: TaskContext, trigger: Trigger, op: str, out: Outbox) -> TriggerResult:
    """Evaluate `trigger` (with operation id `op`, "" for none) and apply what it decides
    (`Engine.handle_trigger`)."""
    result = await ctx.engine.handle_trigger(HandleInput(ctx.task_id, trigger, op), out)
    return _trigger_result(result, op or None)


async def event(ctx: TaskContext, command: c.EventTrigger, out: Outbox) -> TriggerResult:
    """An event trigger other than agent errors and children-completed, under its operation id."""
    return await trigger(ctx, EVENT_TRIGGERS[type(command)], operation_id(command), out)


async def agent_error(ctx: TaskContext, command: c.AgentError, out: Outbox) -> TriggerResult:
    """Evaluate on_agent_error evaluate-only; commit a deferred transition, then mark — iff it committed.

    The operation's lock is held from before the task is loaded until after the mark, so a concurrent
    delivery evaluates the committed state (evaluate-only-operation-marking.md AC-EO-10, AC-EO-11,
    AC-EO-13, AC-EO-17).
    """
    op = operation_id(command)
    async with ctx.locks.agent_error.hold(op):
        inp = HandleInput(ctx.task_id, Trigger.on_agent_error, op, evaluate_only=True)
        result = await ctx.engine.handle_trigger(inp, out)
        committed = False
        if result.operation_mark_deferred:
            committed = await _commit_deferred(ctx, result, op, inp.trigger, out)
            if committed:
                await ctx.services.ledger.mark_applied(op)
    return _trigger_result(result, op, applied=result.applied or committed)


async def children_completed(
    ctx: TaskContext, command: c.ChildrenCompleted, out: Outbox
) -> ChildrenCompletedResult | ChildrenNotTerminal | AlreadyApplied:
    """Check, evaluate, commit, then mark: the caller owns the mark (defer_operation_mark).

    The same child rows always give the same operation id, so the structurally double delivery (a state
    change plus a direct call) applies its transition once (operation-ledger-lifetime.md AC-B1, AC-R2).
    The trigger fires only when every child is terminal (actors/engine/children.py): otherwise nothing runs
    and nothing is marked, so a later complete set still fires, and `not_terminal` names the open children.

    Raises NotFoundError (field children.<i>.workflow_id / .step_id) for a row naming no such place.
    """
    op = operation_id(command)
    ledger = ctx.services.ledger
    async with ctx.locks.child_completion.hold(op):
        if await ledger.is_applied(op):
            return AlreadyApplied(idempotent=True, operation_id=op)
        pending = await _children_not_terminal(ctx, command.children)
        if pending:
            out.diagnostic(
                "info",
                "children_not_terminal",
                task_id=ctx.task_id,
                operation_id=op,
                not_terminal=[row["task_id"] for row in pending],
            )
            return ChildrenNotTerminal(
                idempotent=False, transitioned=False, applied=False, operation_id=op, not_terminal=pending
            )
        inp = HandleInput(
            ctx.task_id, Trigger.on_children_completed, op, evaluate_only=True, defer_operation_mark=True
        )
        result = await ctx.engine.handle_trigger(inp, out)
        committed = not result.transitioned or await _commit_deferred(ctx, result, op, inp.trigger, out)
        if committed:
            await ledger.mark_applied(op)
    return ChildrenCompletedResult(
        idempotent=result.idempotent,
        from_step=result.from_step,
        to_step=result.to_step,
        transitioned=result.transitioned,
        applied=result.transitioned and committed,
        operation_mark_deferred=result.operation_mark_deferred,
        operation_id=op,
        not_terminal=[],
    )


async def _children_not_terminal(ctx: TaskContext, rows: list[c.ChildRow]) -> list[OpenChild]:
    """The rows that are not terminal (actors/engine/children.py); task rows are read only for open children
    whose row names no place."""
    registered = ctx.services.workflows.workflows
    children.check_places(rows, registered)
    unplaced = children.unplaced(rows)
    stored: dict[str, children.Place] = {}
    if unplaced:
        stored = await ctx.store.transact(tasks.places, unplaced)
    return children.not_terminal(rows, stored, registered)


async def _commit_deferred(
    ctx: TaskContext, result: HandleResult, op: str, trigger: Trigger, out: Outbox
) -> bool:
    """Commit a deferred transition; False (and a warning) on any of the non-committing paths.

    Those are: the source step no longer loads, the target step is missing, the host's preflight
    refuses, the write fails, or the task already left the source step (AC-EO-11). A storage fault is
    re-raised after the warning, so the command's reply is the typed `StorageError`.
    """
    services = ctx.services
    try:
        task = await ctx.load()
        workflow = services.workflows.for_task(task)
        source = find_step(workflow, result.from_step or "")
        target = find_step(workflow, result.to_step or "")
        at_source = attrs.evolve(task, step_id=source.id)
        return await ctx.engine.enter_step(
            at_source, workflow, target, path="E1", trigger=str(trigger), out=out, operation_id=op
        )
    except Exception as exc:  # every failure leaves the operation retryable
        out.diagnostic(
            "warning",
            "deferred_commit_failed",
            task_id=ctx.task_id,
            session_id=None,
            operation_id=op,
            from_step=result.from_step,
            to_step=result.to_step,
            cause=repr(exc),
        )
        if isinstance(exc, StorageError):  # still unmarked (AC-EO-11), and the reply says why, typed
            raise
        return False
