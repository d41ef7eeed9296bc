"""Commands a host sends to the runtime, as pydantic v2 models discriminated on `type`.

Every command is one JSON object on the wire (see `codec.py`). Unknown fields are rejected so a typo in a
host never silently does nothing. Identifiers are non-empty strings; times are Unix seconds.
Every field is bounded (`limits.py`, shown by `onceflow schema`): ids at most MAX_ID_CHARS characters without
control characters, free text MAX_TEXT_CHARS, integers int64, lists MAX_LIST_ITEMS; a string holding a lone
surrogate is not valid Unicode and is refused. Source: the foundation issue, "Protocol"; operation-id shapes
from operation-ledger-lifetime.md; bounds from issue 11, "Bounded everything".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from onceflow.protocol.limits import (
    ID_PATTERN,
    INT64_MAX,
    INT64_MIN,
    MAX_ID_CHARS,
    MAX_LIST_ITEMS,
    MAX_SOURCE_CHARS,
    MAX_TEMPLATE_BYTES,
    MAX_TEXT_CHARS,
)
from onceflow.protocol.outcome import CoordinatorAck as CoordinatorAck  # re-exported: the outcome commands
from onceflow.protocol.outcome import GetOutcome as GetOutcome
from onceflow.protocol.outcome import OutcomeReady as OutcomeReady

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]
"""A required identifier."""
Name = Annotated[str, Field(max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]
"""An optional identifier or short name, where empty means "none" (as `agent_profile_id: ""`)."""
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
"""Free text: a title or a comment."""
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Role = Literal["reviewer", "approver", "watcher", "collaborator", "runner"]
Priority = Literal["critical", "high", "medium", "low"]


class _Command(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RegisterWorkflow(_Command):
    """Register (or replace) a workflow from template YAML text; `source` names it in errors."""

    type: Literal["register_workflow"] = "register_workflow"
    yaml: Annotated[str, Field(max_length=MAX_TEMPLATE_BYTES)]
    source: Annotated[str, Field(min_length=1, max_length=MAX_SOURCE_CHARS, pattern=ID_PATTERN)] = (
        "<protocol>"
    )
    import_path: bool = False
    """Accept the import path's extra action types (run_code_review and configure_session under on_enter,
    transitions under the event triggers); templates otherwise get the strict allow-lists."""


class CreateTask(_Command):
    """Create a task at `step_id` (default: the workflow's start step). Creation is not a step entry."""

    type: Literal["create_task"] = "create_task"
    task_id: Id
    workflow_id: Id
    step_id: Name | None = None
    title: Text = ""
    session_id: Name | None = None
    primary_agent_id: Name | None = None
    ceo_agent_id: Name | None = None
    priority: Priority = "medium"


class AddParticipant(_Command):
    """Add a participant row. With `task_id` it is per-task; otherwise template-level for `workflow_id`."""

    type: Literal["add_participant"] = "add_participant"
    step_id: Id
    role: Role
    agent_profile_id: Name = ""
    decision_required: bool = True
    position: Int64 = 0
    task_id: Name | None = None
    workflow_id: Name | None = None

    @model_validator(mode="after")
    def _scope(self) -> AddParticipant:
        if not self.task_id and not self.workflow_id:
            raise ValueError("one of task_id (per-task row) or workflow_id (template row) is required")
        return self


class RemoveParticipant(_Command):
    type: Literal["remove_participant"] = "remove_participant"
    participant_id: Int64


class TurnStart(_Command):
    """The task's agent started a turn: fires on_turn_start."""

    type: Literal["turn_start"] = "turn_start"
    task_id: Id


class TurnComplete(_Command):
    """The task's agent finished a turn: fires on_turn_complete (entry path E1 on a transition)."""

    type: Literal["turn_complete"] = "turn_complete"
    task_id: Id


class MoveTask(_Command):
    """Manual move (entry path E2). A move to the task's current step is not an entry and does nothing."""

    type: Literal["move_task"] = "move_task"
    task_id: Id
    step_id: Id


class RecordDecision(_Command):
    """Record a reviewer/approver decision; re-evaluates the step's guarded on_turn_complete transitions.

    With `decision_id` the operation id is `decision:<task>:<step>:<decision_id>`: a redelivery is
    idempotent, and after a restart it records nothing (a durable receipt) and only re-evaluates the
    guards. Without it every delivery records a new decision.
    """

    type: Literal["record_decision"] = "record_decision"
    task_id: Id
    step_id: Id
    decider_type: Literal["agent", "user"]
    decider_id: Id
    decision: Literal["approved", "rejected", "changes_requested"]
    role: Name = ""
    participant_id: Int64 | None = None
    comment: Text = ""
    decision_id: Name | None = None


class SwitchWorkflow(_Command):
    """Move the task into another workflow at `step_id` (default: its start step): entry path E4."""

    type: Literal["switch_workflow"] = "switch_workflow"
    task_id: Id
    workflow_id: Id
    step_id: Name | None = None
    operation_id: Name | None = None


class UpdateTask(_Command):
    """Generic task update; a changed `step_id` is entry path E5."""

    type: Literal["update_task"] = "update_task"
    task_id: Id
    title: Text | None = None
    priority: Priority | None = None
    step_id: Name | None = None
    session_id: Name | None = None
    primary_agent_id: Name | None = None


class StartTask(_Command):
    """Start the task (optionally attaching a session); a step change is entry path E5."""

    type: Literal["start_task"] = "start_task"
    task_id: Id
    step_id: Name | None = None
    session_id: Name | None = None


class DeleteTask(_Command):
    type: Literal["delete_task"] = "delete_task"
    task_id: Id


class ClaimRun(_Command):
    """Atomically claim the oldest queued run for an agent profile (reply result is the run or null)."""

    type: Literal["claim_run"] = "claim_run"
    agent_profile_id: Id


class FinishRun(_Command):
    type: Literal["finish_run"] = "finish_run"
    run_id: Int64
    status: Literal["finished", "failed"] = "finished"


# --- event triggers: each carries what its operation id is built from -----------------------------


class TaskComment(_Command):
    """on_comment; operation id `task_comment:<comment_id>`."""

    type: Literal["task_comment"] = "task_comment"
    task_id: Id
    comment_id: Id


class BlockersResolved(_Command):
    """on_blocker_resolved; operation id `blockers_resolved:<task>`."""

    type: Literal["blockers_resolved"] = "blockers_resolved"
    task_id: Id


class ChildRow(_Command):
    """One child of the parent: its task state and, optionally, where it sits (`workflow_id` + `step_id`).

    Without a place the runtime uses the child's own task row when the child is one of its tasks. The
    place is not part of the operation id (only task_id and state are hashed).
    """

    task_id: Id
    state: Name
    workflow_id: Id | None = None
    step_id: Id | None = None

    @model_validator(mode="after")
    def _place(self) -> ChildRow:
        if (self.workflow_id is None) != (self.step_id is None):
            raise ValueError("workflow_id and step_id name the child's place together: give both or neither")
        return self


class ChildrenCompleted(_Command):
    """on_children_completed; operation id `on_children_completed:<parent>:<sha256 of the child rows>`.

    Fires only when every child is terminal (issue 16 item 2, `actors/children.py`); otherwise nothing runs,
    nothing is marked, and the reply's `not_terminal` lists the children still open.
    """

    type: Literal["children_completed"] = "children_completed"
    task_id: Id
    children: list[ChildRow] = Field(min_length=1, max_length=MAX_LIST_ITEMS)


class ApprovalResolved(_Command):
    """on_approval_resolved; operation id `approval_resolved:<approval_id>`."""

    type: Literal["approval_resolved"] = "approval_resolved"
    task_id: Id
    approval_id: Id


class AgentError(_Command):
    """on_agent_error; operation id `agent_error:<run_id>`, or `agent_error:<session>:<execution>`."""

    type: Literal["agent_error"] = "agent_error"
    task_id: Id
    run_id: Name | None = None
    session_id: Name | None = None
    execution_id: Name | None = None

    @model_validator(mode="after")
    def _identity(self) -> AgentError:
        if not self.run_id and not (self.session_id and self.execution_id):
            raise ValueError("run_id, or both session_id and execution_id, are required")
        return self


class Heartbeat(_Command):
    """on_heartbeat; operation id `heartbeat:<task>:<step>:<unix>` (unix: whole seconds)."""

    type: Literal["heartbeat"] = "heartbeat"
    task_id: Id
    step_id: Id
    unix: Int64


class BudgetAlert(_Command):
    """on_budget_alert; operation id `budget:<ws>:<scope>:<scope_id>:<pct>:<period_start>`."""

    type: Literal["budget_alert"] = "budget_alert"
    task_id: Id
    workspace_id: Id
    scope: Id
    scope_id: Id
    pct: Int64
    period_start: Int64


# --- queries ----------------------------------------------------------------------------------------


class GetTask(_Command):
    type: Literal["get_task"] = "get_task"
    task_id: Id


class ListTasks(_Command):
    """A page of tasks in task-id order: those after `after_task_id` (exclusive; None = from the first), at
    most `limit` (1..1000, default 100). Result `{tasks: [get_task shape...], next_after_task_id}`, the
    latter None on the last page, else the value to pass for the next one. Source: issue 13 item 4."""

    type: Literal["list_tasks"] = "list_tasks"
    after_task_id: Name | None = None
    limit: int = Field(default=100, ge=1, le=1000)


class ListRuns(_Command):
    type: Literal["list_runs"] = "list_runs"
    task_id: Name | None = None
    agent_profile_id: Name | None = None
    status: Literal["queued", "claimed", "finished", "failed"] | None = None


class ListDecisions(_Command):
    type: Literal["list_decisions"] = "list_decisions"
    task_id: Id
    step_id: Name | None = None


class ListStepEntries(_Command):
    type: Literal["list_step_entries"] = "list_step_entries"
    task_id: Id


class ListReviewRuns(_Command):
    """Code-review passes started by run_code_review (of one task, or all): each with its review-run id and
    entry identity, so a host can tell a launch repeated after a crash from a new entry's (issue 12 item 7).
    """

    type: Literal["list_review_runs"] = "list_review_runs"
    task_id: Name | None = None


EventTrigger = (
    TaskComment
    | BlockersResolved
    | ChildrenCompleted
    | ApprovalResolved
    | AgentError
    | Heartbeat
    | BudgetAlert
)

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
    | FinishRun
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
    | ListDecisions
    | ListStepEntries
    | ListReviewRuns
    | OutcomeReady
    | CoordinatorAck
    | GetOutcome,
    Field(discriminator="type"),
]


COMMAND_TYPES: tuple[type[BaseModel], ...] = get_args(get_args(Command)[0])
"""Every command model class (what `Runtime.send` accepts without decoding)."""


def task_id_of(command: Any) -> str | None:
    """The task a command is routed to (its task actor), or None for runtime-level commands.

    A per-task AddParticipant is routed to its task; a template-level one is not.
    """
    if isinstance(
        command, RegisterWorkflow | ClaimRun | FinishRun | RemoveParticipant | ListRuns | ListReviewRuns
    ):
        return None
    task_id = getattr(command, "task_id", None)
    return task_id if isinstance(task_id, str) and task_id else None
