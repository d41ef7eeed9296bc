"""The event commands, each firing its trigger on the task's step (task_comment fires on_comment, ...):
each carries what its operation id is built from (operation-ledger-lifetime.md). Pure: the wire, no thread.

The rules every command shares (unknown fields refused, bounded fields) are `commands.py`'s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from onceflow.protocol.commands.fields import (
    BaseCommand,
    CommandModel,
    Id,
    Int64,
    Name,
)
from onceflow.protocol.limits import (
    MAX_LIST_ITEMS,
)
from onceflow.protocol.times import WholeInstant


class TaskComment(BaseCommand):
    """on_comment; operation id `task_comment:<comment_id>`."""

    type: Literal["task_comment"] = "task_comment"
    """The command name."""
    task_id: Id
    """The task commented on."""
    comment_id: Id
    """The comment's id: a redelivery with the same id is idempotent."""


class BlockersResolved(BaseCommand):
    """on_blocker_resolved; operation id `blockers_resolved:<task>`."""

    type: Literal["blockers_resolved"] = "blockers_resolved"
    """The command name."""
    task_id: Id
    """The task whose blockers are resolved."""


class ChildRow(CommandModel):
    """One child of the parent: its task state and, optionally, where it sits (`workflow_id` + `step_id`).

    Without a place the runtime uses the child's own task row when the child is one of its tasks. The
    place is not part of the operation id (only task_id and state are hashed).
    """

    task_id: Id
    """The child task's id."""
    state: Name
    """The child's state; COMPLETED, FAILED and CANCELLED (any case) are terminal."""
    workflow_id: Id | None = None
    """The workflow the child sits in (with `step_id`); its terminal step counts as terminal."""
    step_id: Id | None = None
    """The step the child sits at (with `workflow_id`)."""

    @model_validator(mode="after")
    def _place(self) -> ChildRow:
        if (self.workflow_id is None) != (self.step_id is None):
            raise ValueError("workflow_id and step_id name the child's place together: give both or neither")
        return self


class ChildrenCompleted(BaseCommand):
    """on_children_completed; operation id `on_children_completed:<parent>:<sha256 of the child rows>`.

    Fires only when every child is terminal (`actors/engine/children.py`); otherwise nothing runs, nothing is
    marked, and the reply's `not_terminal` lists the children still open.
    """

    type: Literal["children_completed"] = "children_completed"
    """The command name."""
    task_id: Id
    """The parent task."""
    children: list[ChildRow] = Field(min_length=1, max_length=MAX_LIST_ITEMS)
    """Every child of the parent, with its state."""


class ApprovalResolved(BaseCommand):
    """on_approval_resolved; operation id `approval_resolved:<approval_id>`."""

    type: Literal["approval_resolved"] = "approval_resolved"
    """The command name."""
    task_id: Id
    """The task the approval was for."""
    approval_id: Id
    """The approval's id: a redelivery with the same id is idempotent."""


class AgentError(BaseCommand):
    """on_agent_error; operation id `agent_error:<run_id>`, or `agent_error:<session>:<execution>`."""

    type: Literal["agent_error"] = "agent_error"
    """The command name."""
    task_id: Id
    """The task whose agent failed."""
    run_id: Name | None = None
    """The failed run; identifies the error (else session_id with execution_id)."""
    session_id: Name | None = None
    """The session of the failed execution (with `execution_id`, when there is no run_id)."""
    execution_id: Name | None = None
    """The failed execution (with `session_id`)."""

    @model_validator(mode="after")
    def _identity(self) -> AgentError:
        if not self.run_id and not (self.session_id and self.execution_id):
            raise ValueError("run_id, or both session_id and execution_id, are required")
        return self


class Heartbeat(BaseCommand):
    """on_heartbeat; operation id `heartbeat:<task>:<step>:<unix>` (unix: whole seconds)."""

    type: Literal["heartbeat"] = "heartbeat"
    """The command name."""
    task_id: Id
    """The task the heartbeat is for."""
    step_id: Id
    """The step the heartbeat is for."""
    unix: WholeInstant
    """The heartbeat's time in whole seconds: RFC 3339 UTC, or an integer of Unix seconds (the operation id
    carries it as Unix seconds)."""


class BudgetAlert(BaseCommand):
    """on_budget_alert; operation id `budget:<ws>:<scope>:<scope_id>:<pct>:<period_start>`."""

    type: Literal["budget_alert"] = "budget_alert"
    """The command name."""
    task_id: Id
    """The task whose step's on_budget_alert fires."""
    workspace_id: Id
    """The workspace whose budget crossed a threshold."""
    scope: Id
    """What the budget is for (the host's scope kind)."""
    scope_id: Id
    """Which one of the scope."""
    pct: Int64
    """The threshold crossed, in percent of the budget."""
    period_start: WholeInstant
    """The start of the budget period in whole seconds: RFC 3339 UTC, or an integer of Unix seconds (the
    operation id carries it as Unix seconds)."""


EventTrigger = (
    TaskComment
    | BlockersResolved
    | ChildrenCompleted
    | ApprovalResolved
    | AgentError
    | Heartbeat
    | BudgetAlert
)
