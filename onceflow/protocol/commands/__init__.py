"""Commands a host sends to the runtime, as pydantic v2 models discriminated on `type`. Pure: the wire, no
thread.

Every command is one JSON object on the wire (see `codec.py`). Unknown fields are rejected so a typo in a
host never silently does nothing. Identifiers are non-empty strings; a time is RFC 3339 UTC text, as in
results and events (`times.py`), and a command's time also accepts a number of Unix seconds.
Every field is bounded (`limits.py`, shown by `onceflow schema`): ids at most MAX_ID_CHARS characters without
control characters, free text MAX_TEXT_CHARS, integers int64, lists MAX_LIST_ITEMS; a string holding a lone
surrogate is not valid Unicode and is refused. Operation-id shapes follow operation-ledger-lifetime.md.

The models live by subject, and this module re-exports them: `task_commands`, `trigger_commands` (the event
commands), `run_commands`, `flow_commands` (limits and pauses), `workflow_commands`, `outcome` (the
coordinator's), on `command_fields` (the base models and shared field types). Here: the `Command` union,
`COMMAND_TYPES`, and which actor handles each command (`route`).
"""

from __future__ import annotations

from typing import Annotated, TypeGuard, cast, get_args

from pydantic import BaseModel, Field

from onceflow.protocol.commands.fields import (
    HISTORY_CURSOR,
    Id,
    Int64,
    Limit,
    Name,
    Priority,
    Role,
    Text,
)
from onceflow.protocol.commands.flow import (
    Count,
    ListPauses,
    Pause,
    PauseScope,
    QueueStats,
    Resume,
    SetLimits,
)
from onceflow.protocol.commands.runs import (
    MAX_RESULT_BYTES,
    CancelRun,
    ClaimRun,
    FinishRun,
    GetRun,
    ListHostCalls,
    ListReviewRuns,
    ListRuns,
    RenewRun,
    RequeueRun,
    RetryRun,
    Seconds,
)
from onceflow.protocol.commands.tasks import (
    AddParticipant,
    CreateTask,
    DeleteTask,
    GetTask,
    ListDecisions,
    ListParticipants,
    ListStepEntries,
    ListTasks,
    MoveTask,
    RecordDecision,
    RemoveParticipant,
    StartTask,
    TaskHistory,
    TurnComplete,
    TurnStart,
    UpdateTask,
)
from onceflow.protocol.commands.triggers import (
    AgentError,
    ApprovalResolved,
    BlockersResolved,
    BudgetAlert,
    ChildrenCompleted,
    ChildRow,
    EventTrigger,
    Heartbeat,
    TaskComment,
)
from onceflow.protocol.commands.workflows import (
    GetWorkflow,
    ListWorkflows,
    MigrateTasks,
    RegisterWorkflow,
    SwitchWorkflow,
)
from onceflow.protocol.outcome import (
    CoordinatorAck,
    GetOutcome,
    OutcomeReady,
)

__all__ = [
    "COMMAND_TYPES",
    "HISTORY_CURSOR",
    "MAX_RESULT_BYTES",
    "AddParticipant",
    "AgentError",
    "ApprovalResolved",
    "BlockersResolved",
    "BudgetAlert",
    "CancelRun",
    "ChildRow",
    "ChildrenCompleted",
    "ClaimRun",
    "Command",
    "CoordinatorAck",
    "Count",
    "CreateTask",
    "DeleteTask",
    "EventTrigger",
    "FinishRun",
    "GetOutcome",
    "GetRun",
    "GetTask",
    "GetWorkflow",
    "Heartbeat",
    "Id",
    "Int64",
    "Limit",
    "ListDecisions",
    "ListHostCalls",
    "ListParticipants",
    "ListPauses",
    "ListReviewRuns",
    "ListRuns",
    "ListStepEntries",
    "ListTasks",
    "ListWorkflows",
    "MigrateTasks",
    "MoveTask",
    "Name",
    "OutcomeReady",
    "Pause",
    "PauseScope",
    "Priority",
    "QueueStats",
    "RecordDecision",
    "RegisterWorkflow",
    "RemoveParticipant",
    "RenewRun",
    "RequeueRun",
    "Resume",
    "RetryRun",
    "Role",
    "RuntimeCommand",
    "Seconds",
    "SetLimits",
    "StartTask",
    "SwitchWorkflow",
    "TaskCommand",
    "TaskComment",
    "TaskHistory",
    "Text",
    "TurnComplete",
    "TurnStart",
    "UpdateTask",
    "is_command",
    "route",
]

Command = Annotated[
    RegisterWorkflow
    | CreateTask
    | AddParticipant
    | RemoveParticipant
    | TurnStart
    | TurnComplete
    | MoveTask
    | RecordDecision
    | SwitchWorkflow
    | UpdateTask
    | StartTask
    | DeleteTask
    | ClaimRun
    | RenewRun
    | FinishRun
    | CancelRun
    | TaskComment
    | BlockersResolved
    | ChildrenCompleted
    | ApprovalResolved
    | AgentError
    | Heartbeat
    | BudgetAlert
    | GetTask
    | ListTasks
    | ListRuns
    | GetRun
    | RequeueRun
    | RetryRun
    | SetLimits
    | Pause
    | Resume
    | ListPauses
    | QueueStats
    | ListDecisions
    | ListStepEntries
    | ListReviewRuns
    | TaskHistory
    | ListHostCalls
    | MigrateTasks
    | ListWorkflows
    | GetWorkflow
    | ListParticipants
    | OutcomeReady
    | CoordinatorAck
    | GetOutcome,
    Field(discriminator="type"),
]


COMMAND_TYPES: tuple[type[BaseModel], ...] = get_args(get_args(Command)[0])
"""Every command model class (what `Runtime.send` accepts without decoding)."""


TaskCommand = (
    CreateTask
    | AddParticipant
    | TurnStart
    | TurnComplete
    | MoveTask
    | RecordDecision
    | SwitchWorkflow
    | UpdateTask
    | StartTask
    | DeleteTask
    | EventTrigger
    | GetTask
    | ListDecisions
    | ListStepEntries
)
"""The commands a task's actor handles: they name the task (`AddParticipant` only with `task_id`)."""

RuntimeCommand = (
    RegisterWorkflow
    | AddParticipant
    | RemoveParticipant
    | ClaimRun
    | RenewRun
    | FinishRun
    | CancelRun
    | GetRun
    | RequeueRun
    | RetryRun
    | SetLimits
    | Pause
    | Resume
    | ListPauses
    | QueueStats
    | ListTasks
    | ListRuns
    | ListReviewRuns
    | TaskHistory
    | ListHostCalls
    | MigrateTasks
    | ListWorkflows
    | GetWorkflow
    | ListParticipants
    | OutcomeReady
    | CoordinatorAck
    | GetOutcome
)
"""The commands the runtime handles itself (`AddParticipant` without `task_id`: a template-level seat)."""

_RUNTIME_TYPES = get_args(RuntimeCommand)

_EXACT_TYPES = frozenset(COMMAND_TYPES)
_EXACT_TASK_TYPES = frozenset(t for t in COMMAND_TYPES if not issubclass(t, _RUNTIME_TYPES))
"""The command classes, and those of them (and of no runtime command) that always go to a task's actor:
an exact type is looked up in these first, since an isinstance over a tuple of pydantic classes asks each
class's metaclass in turn."""


def is_command(value: object) -> TypeGuard[BaseModel]:
    """Whether `value` is an instance of a command model (`COMMAND_TYPES`)."""
    kind = type(value)
    return kind in _EXACT_TYPES or (issubclass(kind, BaseModel) and isinstance(value, COMMAND_TYPES))


def route(command: BaseModel) -> tuple[str, TaskCommand] | RuntimeCommand:
    """(the task id, the command) for a command its task's actor handles, else the command itself, which
    the runtime handles. Raises TypeError for a model that is not a command."""
    if type(command) in _EXACT_TASK_TYPES:
        task_id = getattr(command, "task_id", None)
        if isinstance(task_id, str):
            return task_id, cast(TaskCommand, command)
    if isinstance(command, AddParticipant):
        return (command.task_id, command) if command.task_id else command
    if isinstance(command, _RUNTIME_TYPES):
        return cast(RuntimeCommand, command)
    task_id = getattr(command, "task_id", None)
    if not isinstance(command, COMMAND_TYPES) or not isinstance(task_id, str):
        raise TypeError(f"not a command: {type(command).__name__}")
    return task_id, cast(TaskCommand, command)
