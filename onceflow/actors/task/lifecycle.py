"""A task's life outside the workflow's triggers: creation, field updates, seats, deletion and the task's
queries. Trio thread: each is one or two store requests."""

from __future__ import annotations

from typing import Any

from onceflow.actors.engine.participants import add_participant
from onceflow.actors.engine.promotion import promote
from onceflow.actors.engine.publish import publish_run_changes
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.task.context import TaskContext
from onceflow.actors.task.moves import move
from onceflow.protocol import commands as c
from onceflow.protocol import trusted
from onceflow.protocol.events import TaskQueued
from onceflow.protocol.results import DecisionPage, ParticipantAdded, StepEntryPage, TaskDeleted, TaskInfo
from onceflow.protocol.workflow import find_step
from onceflow.store.entries import participants, step_entries
from onceflow.store.tasks import tasks
from onceflow.store.writer import Grouped

_CREATIONS = "creations"
"""The head of `create`'s group key: a writer batch's creations into one step run together
(`tasks.create_tasks`)."""


async def create(ctx: TaskContext, command: c.CreateTask, out: Outbox) -> TaskInfo:
    """Create the task where `wip.place` lands it (not an entry: no on_enter runs). Into a full step it is
    queued there, or, when the step has a feeder with room, placed in the feeder tagged for the step
    (kandev-engine-notes.md, WIP limits). The row is cached as committed: its first move needs no read.

    Raises:
        WipLimitError: the step and its feeder are both full (field step_id).
        ConflictError: the task id is taken (field task_id).
    """
    services = ctx.services
    workflow = services.workflows.get(command.workflow_id)
    target = find_step(workflow, command.step_id) if command.step_id else workflow.start_step
    feeder = workflow.step(target.pull_from_step_id) if target.pull_from_step_id else None
    version = services.workflows.newest.get(workflow.id, 1)
    now = services.now()
    if target.wip_limit > 0:  # a placement to read: created alone
        task = await ctx.store.transact(tasks.create_task, command, workflow.id, target, feeder, now, version)
    else:  # with the batch's other creations into the same step (`tasks.create_tasks`)
        key = (_CREATIONS, workflow.id, target.id, version)
        group = Grouped(key, (command, now, workflow.id, target, version), tasks.create_tasks)
        task = await ctx.store.transact_grouped(
            group, tasks.create_task, command, workflow.id, target, feeder, now, version
        )
    services.task_rows.put(task)
    out.emit(trusted.task_created(task_id=task.id, workflow_id=workflow.id, step_id=task.step_id))
    if not task.wip_admitted:
        out.emit(TaskQueued(task_id=task.id, step_id=task.step_id))
    return tasks.task_info(task)


async def delete(ctx: TaskContext, out: Outbox) -> TaskDeleted:
    """Delete the task: its queued and claimed runs are cancelled (`run_cancelled`, reason
    `task_deleted`), then its rows cascade; a slot it held is freed for promotion. Raises NotFoundError."""
    task = await ctx.load()
    cancelled = await ctx.store.transact(tasks.remove_task, ctx.task_id, ctx.services.now())
    publish_run_changes(out, cancelled)
    workflow = ctx.services.workflows.pinned(task)
    if workflow is not None and workflow.has_step(task.step_id) and task.wip_admitted:
        await promote(ctx.services, workflow, workflow.step(task.step_id))
    return TaskDeleted(deleted=True)


async def update(ctx: TaskContext, command: c.UpdateTask, out: Outbox) -> TaskInfo:
    """Update the given fields; a `step_id` then moves the task (entry path E5). Raises NotFoundError."""
    fields: dict[str, Any] = {
        name: value
        for name in ("title", "priority", "session_id", "primary_agent_id")
        if (value := getattr(command, name)) is not None
    }
    await ctx.store.transact(tasks.update_task, ctx.task_id, fields, ctx.services.now())
    if command.step_id:
        await move(ctx, command.step_id, "E5", "update_task", out)
    return tasks.task_info(await ctx.load())


async def start(ctx: TaskContext, command: c.StartTask, out: Outbox) -> TaskInfo:
    """Set the session, if given; a `step_id` then moves the task (entry path E5). Raises NotFoundError."""
    if command.session_id:
        fields = {"session_id": command.session_id}
        await ctx.store.transact(tasks.update_task_fields, ctx.task_id, fields, ctx.services.now())
    if command.step_id:
        await move(ctx, command.step_id, "E5", "start_task", out)
    return tasks.task_info(await ctx.load())


async def add_own_participant(ctx: TaskContext, command: c.AddParticipant) -> ParticipantAdded:
    """Seat a participant on this task alone (`participants.add_participant` states the rule)."""
    task = await ctx.load()
    workflow = ctx.services.workflows.for_task(task)
    return await add_participant(ctx.services, command, workflow=workflow, task_id=ctx.task_id)


async def get(ctx: TaskContext) -> TaskInfo:
    """The task as stored. Raises NotFoundError."""
    return tasks.task_info(await ctx.load())


async def list_decisions(ctx: TaskContext, command: c.ListDecisions) -> DecisionPage:
    """A page of the task's decisions (at `step_id`, when given) in decision-id order (oldest first)."""
    rows, more = await ctx.store.transact(
        participants.decisions_page,
        task_id=ctx.task_id,
        step_id=command.step_id,
        after_id=command.after_decision_id,
        limit=command.limit,
    )
    return DecisionPage(
        decisions=[participants.decision_info(row) for row in rows],
        next_after_decision_id=rows[-1].id if more else None,
    )


async def list_step_entries(ctx: TaskContext, command: c.ListStepEntries) -> StepEntryPage:
    """A page of the task's step entries with their markers, in (step, entry_seq) order."""
    after = (
        None
        if command.after_step_id is None or command.after_entry_seq is None
        else (ctx.task_id, command.after_step_id, command.after_entry_seq)
    )
    entries, more = await ctx.store.transact(
        step_entries.entries_page, task_id=ctx.task_id, after=after, limit=command.limit
    )
    last = entries[-1] if more else None
    return StepEntryPage(
        entries=entries,
        next_after_step_id=last["step_id"] if last else None,
        next_after_entry_seq=last["entry_seq"] if last else None,
    )
