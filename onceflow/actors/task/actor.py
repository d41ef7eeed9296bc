"""The task actor: one per task, serializing every command for that task. Trio thread.

Spawned on the task's first message and routed by task id (actors/runtime/supervisor.py); its mailbox
survives a crash of the actor, which the supervisor restarts (nothing it needs lives only in memory: state
is reloaded from the store). It routes each command to the handler of its family: lifecycle (create,
update, start, seats, delete, queries), moves (E2, E4, E5, promotions), triggers, decisions.
"""

from __future__ import annotations

from typing import TypeAlias

import attrs

from onceflow.actors.kernel import causation
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.task import decisions, lifecycle, migrate, moves, triggers
from onceflow.actors.task.context import TaskContext
from onceflow.actors.task.migrate import MigrateTask
from onceflow.protocol import commands as c
from onceflow.protocol.results import (
    AlreadyApplied,
    ChildrenCompletedResult,
    ChildrenNotTerminal,
    DecisionPage,
    DecisionResult,
    MoveResult,
    ParticipantAdded,
    StepEntryPage,
    TaskDeleted,
    TaskInfo,
    TriggerResult,
    WorkflowSwitched,
)
from onceflow.protocol.workflow import Trigger
from onceflow.store.entries.wip import Promotion
from onceflow.store.tasks.task_migration import TaskPlan

TaskMessage: TypeAlias = c.TaskCommand | Promotion | MigrateTask
"""What a task actor handles: a command naming the task, a committed promotion of it to dispatch, or its
part of a `migrate_tasks`."""

TaskResult: TypeAlias = (
    TaskInfo
    | TaskDeleted
    | TriggerResult
    | ChildrenCompletedResult
    | ChildrenNotTerminal
    | AlreadyApplied
    | MoveResult
    | WorkflowSwitched
    | DecisionResult
    | ParticipantAdded
    | DecisionPage
    | StepEntryPage
    | TaskPlan
    | bool
    | None
)
"""A handler's reply result (`bool`: whether a promotion's entry was dispatched)."""


_KEEPS_ROW = (c.MoveTask, c.CreateTask, c.GetTask)  # a tuple: an `X | Y` union is built at each call


@attrs.frozen
class TaskActor(TaskContext):
    """Handles the commands of one task with the engine current at each command's start (built per command,
    it is that command's `TaskContext` for the handlers)."""

    async def handle(self, message: TaskMessage, out: Outbox) -> TaskResult:
        """Apply one message. Raises OnceflowError subclasses for refused commands.

        Every command but a move, a creation or a read forgets the task's cached row first: it may write the
        row outside the admission's compare-and-set (actors/kernel/task_rows.py). A cancellation leaves
        what the handler committed so far (every handler states what that is). The runs its actions queue
        carry its causation (actors/kernel/causation.py).
        """
        token = causation.CAUSE.set(causation.cause_of(message, self.services.run_policy.max_causation_depth))
        try:
            return await self._apply(message, out)
        finally:
            causation.CAUSE.reset(token)

    async def _apply(self, message: TaskMessage, out: Outbox) -> TaskResult:
        ctx: TaskContext = self
        if not isinstance(message, _KEEPS_ROW):
            ctx.services.task_rows.forget(self.task_id)
        match message:
            case c.CreateTask():
                return await lifecycle.create(ctx, message, out)
            case c.TurnStart():
                return await triggers.trigger(ctx, Trigger.on_turn_start, "", out)
            case c.TurnComplete():
                return await triggers.trigger(ctx, Trigger.on_turn_complete, "", out)
            case c.MoveTask():
                return await moves.move(ctx, message.step_id, "E2", "move_task", out)
            case c.RecordDecision():
                return await decisions.record_decision(ctx, message, out)
            case c.SwitchWorkflow():
                return await moves.switch_workflow(ctx, message, out)
            case c.UpdateTask():
                return await lifecycle.update(ctx, message, out)
            case c.StartTask():
                return await lifecycle.start(ctx, message, out)
            case c.DeleteTask():
                return await lifecycle.delete(ctx, out)
            case Promotion():
                return await moves.promoted(ctx, message, out)
            case MigrateTask():
                return await migrate.migrate(ctx, message, out)
            case c.AddParticipant():
                return await lifecycle.add_own_participant(ctx, message)
            case c.GetTask():
                return await lifecycle.get(ctx)
            case c.ListDecisions():
                return await lifecycle.list_decisions(ctx, message)
            case c.ListStepEntries():
                return await lifecycle.list_step_entries(ctx, message)
            case c.AgentError():
                return await triggers.agent_error(ctx, message, out)
            case c.ChildrenCompleted():
                return await triggers.children_completed(ctx, message, out)
            case _:
                return await triggers.event(ctx, message, out)
