"""A task changing step on a host's command: a manual move (E2), a move by a task update or start (E5), a
workflow switch (E4), and the dispatch of a WIP promotion's entry (E3). Trio thread."""

from __future__ import annotations

from onceflow.actors.engine.entry import StaleRow
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.task.context import TaskContext
from onceflow.observability import metrics
from onceflow.protocol import commands as c
from onceflow.protocol.events import EntryPath, StepEntered
from onceflow.protocol.operation_ids import switch_workflow_operation_id
from onceflow.protocol.results import AlreadyApplied, MoveResult, WorkflowSwitched
from onceflow.protocol.workflow import find_step
from onceflow.store.entries.wip import Promotion


async def move(ctx: TaskContext, step_id: str, path: EntryPath, trigger: str, out: Outbox) -> MoveResult:
    """Move the task to `step_id` on `path`; a move to the current step is not an entry and does nothing.

    A cached row (actors/kernel/task_rows.py) saves the read: the admission's compare-and-set verifies it,
    and a mismatch (`StaleRow`, nothing written) decides the move again from a fresh read. The no-op answer
    is only ever given from a fresh read.

    Raises:
        NotFoundError: the task, its workflow or the step does not exist.
        TransitionRefusedError, TransitionFailedError, StorageError: as `Engine.enter_step`.
    """
    engine, rows = ctx.engine, ctx.services.task_rows
    cached = rows.get(ctx.task_id)
    if cached is not None:
        rows.forget(ctx.task_id)  # an admission caches its new row; anything else reads afresh
        workflow = ctx.services.workflows.pinned(cached)
        if workflow is not None and workflow.has_step(step_id) and step_id != cached.step_id:
            try:
                moved = await engine.enter_step(
                    cached, workflow, workflow.step(step_id), path=path, trigger=trigger, out=out, cached=True
                )
                return {"moved": moved, "step_id": step_id if moved else cached.step_id}
            except StaleRow:
                pass  # nothing was written: decide it from the committed row
    task = await ctx.load()
    workflow = ctx.services.workflows.for_task(task)
    target = find_step(workflow, step_id)
    if target.id == task.step_id:
        return {"moved": False, "step_id": task.step_id}
    moved = await engine.enter_step(task, workflow, target, path=path, trigger=trigger, out=out)
    return {"moved": moved, "step_id": target.id if moved else task.step_id}


async def switch_workflow(
    ctx: TaskContext, command: c.SwitchWorkflow, out: Outbox
) -> WorkflowSwitched | MoveResult | AlreadyApplied:
    """Entry path E4, deduplicated on `<op>:switch_workflow:on_enter`; both phase keys are marked after the
    entry (operation-ledger-lifetime.md, "Operation id shape"). A switch to where the task already is does
    nothing. Raises NotFoundError (workflow or step) and what `Engine.enter_step` raises."""
    ledger = ctx.services.ledger
    op = switch_workflow_operation_id(command.operation_id, "on_enter") if command.operation_id else ""
    if op and await ledger.is_applied(op):
        return AlreadyApplied(idempotent=True, operation_id=op)
    task = await ctx.load()
    registry = ctx.services.workflows  # within its workflow a task keeps its version; else the newest
    workflow = (
        registry.for_task(task)
        if command.workflow_id == task.workflow_id
        else registry.get(command.workflow_id)
    )
    target = find_step(workflow, command.step_id) if command.step_id else workflow.start_step
    if workflow.id == task.workflow_id and target.id == task.step_id:
        return MoveResult(moved=False, step_id=task.step_id)
    moved = await ctx.engine.enter_step(
        task, workflow, target, path="E4", trigger="switch_workflow", out=out, operation_id=op
    )
    if op:
        await ledger.mark_applied(switch_workflow_operation_id(command.operation_id or "", "on_exit"))
        await ledger.mark_applied(op)
    return WorkflowSwitched(moved=moved, workflow_id=workflow.id, step_id=target.id, operation_id=op or None)


async def promoted(ctx: TaskContext, promotion: Promotion, out: Outbox) -> bool:
    """Dispatch the on_enter of an entry a WIP promotion committed for this task (E3); False when the task
    has moved on since (its open entry is then closed by the next recovery scan)."""
    task = await ctx.load()
    if task.step_id != promotion.step_id or not task.wip_admitted:
        return False
    workflow = ctx.services.workflows.for_task(task)
    step = find_step(workflow, promotion.step_id)
    seq = promotion.key.entry_seq if promotion.key else None
    metrics.count_entry(workflow.id, step.id, "E3")
    out.emit(StepEntered(task_id=task.id, step_id=step.id, entry_seq=seq, entry_path="E3"))
    await ctx.engine.dispatch_entry(task, workflow, step, promotion.key, "E3", out)
    return True
