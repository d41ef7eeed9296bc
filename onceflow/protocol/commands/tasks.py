"""The commands about tasks: create, move, update, start and delete one, its turns, its seats and the
decisions cast from them, and the queries that read a task and its records. Pure: the wire, no thread.

The rules every command shares (unknown fields refused, bounded fields) are `commands.py`'s.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from onceflow.protocol.commands.fields import (
    HISTORY_CURSOR,
    BaseCommand,
    Id,
    Int64,
    Limit,
    Name,
    Priority,
    Role,
    Text,
)
from onceflow.protocol.limits import (
    INT64_MAX,
)


class CreateTask(BaseCommand):
    """Create a task at `step_id` (default: the workflow's start step). Creation is not a step entry."""

    type: Literal["create_task"] = "create_task"
    """The command name."""
    task_id: Id
    """The new task's id; an existing id is a `conflict`."""
    workflow_id: Id
    """A registered workflow."""
    step_id: Name | None = None
    """Where the task starts; None: the workflow's start step. Into a full step it is queued (WIP)."""
    title: Text = ""
    """The task's title."""
    session_id: Name | None = None
    """The agent session the task runs in; session actions name it."""
    primary_agent_id: Name | None = None
    """The agent profile a `queue_run` with target `primary` queues for."""
    ceo_agent_id: Name | None = None
    """The agent profile a `queue_run` with target `workspace.ceo_agent` queues for."""
    priority: Priority = "medium"
    """The task's priority."""


class AddParticipant(BaseCommand):
    """Add a participant row. With `task_id` it is per-task; otherwise template-level for `workflow_id`. The
    same seat again (every field identical) adds nothing: the reply names the row with `already_existed`."""

    type: Literal["add_participant"] = "add_participant"
    """The command name."""
    step_id: Id
    """The step the seat is at."""
    role: Role
    """The seat's role; quorum guards count the seats of one role."""
    agent_profile_id: Name = ""
    """The agent holding the seat ("": none; runs cannot be queued for it)."""
    decision_required: bool = True
    """Whether the seat's decision counts towards quorum guards."""
    position: Int64 = 0
    """Orders the seats of a step (ascending)."""
    task_id: Name | None = None
    """A per-task row for this task (the task's workflow); one of task_id and workflow_id is required."""
    workflow_id: Name | None = None
    """A template-level row, for every task of this workflow at `step_id`."""

    @model_validator(mode="after")
    def _scope(self) -> AddParticipant:
        if not self.task_id and not self.workflow_id:
            raise ValueError("one of task_id (per-task row) or workflow_id (template row) is required")
        return self


class RemoveParticipant(BaseCommand):
    """Remove a participant row (`not_found` when there is none)."""

    type: Literal["remove_participant"] = "remove_participant"
    """The command name."""
    participant_id: Int64
    """The row's id, as `add_participant` returned it."""


class TurnStart(BaseCommand):
    """The task's agent started a turn: fires on_turn_start."""

    type: Literal["turn_start"] = "turn_start"
    """The command name."""
    task_id: Id
    """The task whose agent started a turn."""


class TurnComplete(BaseCommand):
    """The task's agent finished a turn: fires on_turn_complete (entry path E1 on a transition)."""

    type: Literal["turn_complete"] = "turn_complete"
    """The command name."""
    task_id: Id
    """The task whose agent finished a turn."""


class MoveTask(BaseCommand):
    """Manual move (entry path E2). A move to the task's current step is not an entry and does nothing."""

    type: Literal["move_task"] = "move_task"
    """The command name."""
    task_id: Id
    """The task to move."""
    step_id: Id
    """The step to move it to, in its current workflow."""


class RecordDecision(BaseCommand):
    """Record a reviewer/approver decision; re-evaluates the step's guarded on_turn_complete transitions.

    With `decision_id` the operation id is `decision:<task>:<step>:<decision_id>`: a redelivery is
    idempotent, and after a restart it records nothing (a durable receipt) and only re-evaluates the
    guards. Without it every delivery records a new decision. With `entry_seq` a vote never counts outside
    the round it was cast for (docs/guarantees.md).
    """

    type: Literal["record_decision"] = "record_decision"
    """The command name."""
    task_id: Id
    """The task decided on."""
    step_id: Id
    """The step the decision is for; guards are evaluated only while the task is there."""
    decider_type: Literal["agent", "user"]
    """Who decided: an agent (mapped to its seat by role and agent id) or a user."""
    decider_id: Id
    """The agent profile or user id of the decider."""
    decision: Literal["approved", "rejected", "changes_requested"]
    """The verdict."""
    role: Name = ""
    """The decider's role ("": resolved from the seat named by `participant_id` or held by `decider_id`)."""
    participant_id: Int64 | None = None
    """The seat the decision is cast from, when the host knows it."""
    comment: Text = ""
    """The decider's comment."""
    decision_id: Name | None = None
    """The host's id of this decision: makes a redelivery idempotent, also across restarts."""
    entry_seq: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    """The review round the vote was cast for: the step entry (`entry_seq`) of the run or code review that
    asked for it. A vote for an earlier entry of the step than its latest, or for a round the task has
    left, is answered not counted (`earlier_round`, `task_not_at_step`) and recorded nowhere, whatever
    retention pruned; None: the receipt of `decision_id` alone tells a redelivery (as long as retention
    keeps it)."""


class UpdateTask(BaseCommand):
    """Generic task update; a changed `step_id` is entry path E5."""

    type: Literal["update_task"] = "update_task"
    """The command name."""
    task_id: Id
    """The task to update."""
    title: Text | None = None
    """A new title; None leaves it."""
    priority: Priority | None = None
    """A new priority; None leaves it."""
    step_id: Name | None = None
    """A step to move to (entry path E5); None or the current step: no move."""
    session_id: Name | None = None
    """A new session id; None leaves it."""
    primary_agent_id: Name | None = None
    """A new primary agent; None leaves it."""


class StartTask(BaseCommand):
    """Start the task (optionally attaching a session); a step change is entry path E5."""

    type: Literal["start_task"] = "start_task"
    """The command name."""
    task_id: Id
    """The task to start."""
    step_id: Name | None = None
    """A step to move to (entry path E5); None: stay."""
    session_id: Name | None = None
    """A session to attach; None leaves it."""


class DeleteTask(BaseCommand):
    """Delete the task and its rows; a WIP slot it held is freed, admitting a queued task (E3)."""

    type: Literal["delete_task"] = "delete_task"
    """The command name."""
    task_id: Id
    """The task to delete."""


class GetTask(BaseCommand):
    """The task's current row."""

    type: Literal["get_task"] = "get_task"
    """The command name."""
    task_id: Id
    """The task."""


class ListTasks(BaseCommand):
    """A page of tasks in task-id order: those after `after_task_id` (exclusive; None = from the first), at
    most `limit` (1..1000, default 100). Result `{tasks: [get_task shape...], next_after_task_id}`, the
    latter None on the last page, else the value to pass for the next one."""

    type: Literal["list_tasks"] = "list_tasks"
    """The command name."""
    after_task_id: Name | None = None
    """Start after this task id (exclusive); None: from the first task."""
    limit: int = Field(default=100, ge=1, le=1000)
    """At most this many tasks in the page."""


class ListDecisions(BaseCommand):
    """A page of the decisions recorded for a task (at one step, or all) in decision-id order (oldest
    first): those after `after_decision_id` (exclusive; None = from the first), at most `limit` (1..1000,
    default 100). Result `{decisions: [...], next_after_decision_id}` (None on the last page)."""

    type: Literal["list_decisions"] = "list_decisions"
    """The command name."""
    task_id: Id
    """The task."""
    step_id: Name | None = None
    """Only decisions for this step."""
    after_decision_id: Int64 | None = None
    """Start after this decision id (exclusive); None: from the first."""
    limit: Limit = 100
    """At most this many decisions in the page."""


class ListStepEntries(BaseCommand):
    """A page of the task's durable step-entry records, each with its per-action markers, in (step_id,
    entry_seq) order: those after (`after_step_id`, `after_entry_seq`) (exclusive; both None = from the
    first), at most `limit` (1..1000, default 100). Result `{entries: [...], next_after_step_id,
    next_after_entry_seq}` (both None on the last page, else the pair to pass for the next one)."""

    type: Literal["list_step_entries"] = "list_step_entries"
    """The command name."""
    task_id: Id
    """The task."""
    after_step_id: Name | None = None
    """With `after_entry_seq`: start after this entry (exclusive); None: from the first."""
    after_entry_seq: Int64 | None = None
    """With `after_step_id`: the entry_seq of the entry to start after."""
    limit: Limit = 100
    """At most this many entries in the page."""

    @model_validator(mode="after")
    def _cursor(self) -> ListStepEntries:
        if (self.after_step_id is None) != (self.after_entry_seq is None):
            raise ValueError("after_step_id and after_entry_seq name the entry to start after together")
        return self


class TaskHistory(BaseCommand):
    """A page of the task's history, oldest first: its creation, transitions (with trigger and operation
    id), step entries, decisions and runs (queued, claimed, ended), at most `limit` (1..1000, default
    100) items after the cursor `after`. Result `{items, next}`: `next` is None on the last page, else the
    value to pass as `after` for the next one (a page never repeats or skips an item)."""

    type: Literal["task_history"] = "task_history"
    """The command name."""
    task_id: Id
    """The task."""
    after: Annotated[str, Field(max_length=64, pattern=HISTORY_CURSOR)] | None = None
    """Start after this cursor (a page's `next`); None: from the first item."""
    limit: int = Field(default=100, ge=1, le=1000)
    """At most this many items in the page."""


class ListParticipants(BaseCommand):
    """The seats of a task: `{participants: [{participant_id, task_id, workflow_id, step_id, role,
    agent_profile_id, decision_required}]}`, its own and the template-level ones of its workflow (task_id
    None), in step then seat order."""

    type: Literal["list_participants"] = "list_participants"
    """The command name."""
    task_id: Id
    """The task."""
