"""The task actor: one per task, serializing every command for that task. Trio thread.

Spawned on the task's first message and routed by task id (actors/runtime/supervisor.py); its mailbox
survives a crash of the actor, which the supervisor restarts (nothing it needs lives only in memory: state
is reloaded from the store). It routes each command to the handler of its family: lifecycle (create,
update, start, seats, delete, queries), moves (E2, E4, E5, promotions), triggers, decisions.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

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
_KEEPS_ROW_TYPES = frozenset(_KEEPS_ROW)  # looked up before asking each model class's metaclass

Handler: TypeAlias = Callable[[TaskContext, Any, Outbox], Awaitable[TaskResult]]
"""A message family's handler: (the command's context, the message, its outbox) -> its result."""

_HANDLERS: tuple[tuple[type, Handler], ...] = (
    (c.CreateTask, lifecycle.create),
    (c.TurnStart, lambda ctx, _, out: triggers.trigger(ctx, Trigger.on_turn_start, "", out)),
    (c.TurnComplete, lambda ctx, _, out: triggers.trigger(ctx, Trigger.on_turn_complete, "", out)),
    (c.MoveTask, lambda ctx, message, out: moves.move(ctx, message.step_id, "E2", "move_task", out)),
    (c.RecordDecision, decisions.record_decision),
    (c.SwitchWorkflow, moves.switch_workflow),
    (c.UpdateTask, lifecycle.update),
    (c.StartTask, lifecycle.start),
    (c.DeleteTask, lambda ctx, _, out: lifecycle.delete(ctx, out)),
    (Promotion, moves.promoted),
    (MigrateTask, migrate.migrate),
    (c.AddParticipant, lambda ctx, message, _: lifecycle.add_own_participant(ctx, message)),
    (c.GetTask, lambda ctx, _, __: lifecycle.get(ctx)),
    (c.ListDecisions, lambda ctx, message, _: lifecycle.list_decisions(ctx, message)),
    (c.ListStepEntries, lambda ctx, message, _: lifecycle.list_step_entries(ctx, message)),
    (c.AgentError, triggers.agent_error),
    (c.ChildrenCompleted, triggers.children_completed),
)
"""Each message family's handler, the first whose class the message is an instance of; any other command is
a trigger event (`triggers.event`)."""
_BY_TYPE: dict[type, Handler] = dict(_HANDLERS)  # an exact class: one lookup instead of isinstance in turn


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
            if not (type(message) in _KEEPS_ROW_TYPES or isinstance(message, _KEEPS_ROW)):
                self.services.task_rows.forget(self.task_id)
            handler = _BY_TYPE.get(type(message))
            if handler is None:
                handler = next((found for kind, found in _HANDLERS if isinstance(message, kind)), _event)
            return await handler(self, message, out)
        finally:
            causation.CAUSE.reset(token)


def _event(ctx: TaskContext, message: Any, out: Outbox) -> Awaitable[TaskResult]:
    return triggers.event(ctx, message, out)
