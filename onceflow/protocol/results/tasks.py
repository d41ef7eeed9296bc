"""What the task commands return: a task's row, its seats, decisions and step entries, what an event
command or a move did, and the pages of the task queries. Pure: no thread.

Each is a result typed dict (`result_base.py`); `results.py` maps each command type to its result.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from typing_extensions import TypedDict

from onceflow.protocol.events import EntryPath
from onceflow.protocol.results.base import as_result

GuardOutcome = Literal["moved", "quorum_not_met", "move_abandoned", "no_guard", "not_at_step"]
"""What a decision's guards did: moved, quorum_not_met, move_abandoned, no_guard, or not_at_step."""


@as_result
class TaskInfo(TypedDict):
    """A task as stored (`create_task`, `update_task`, `start_task`, `get_task`, `list_tasks`)."""

    task_id: str
    """The task."""
    workflow_id: str
    """Its workflow."""
    step_id: str
    """The step it sits at (admitted, or queued there when `wip_admitted` is false)."""
    title: str
    """Its title."""
    session_id: str | None
    """Its agent session, if any."""
    primary_agent_id: str | None
    """The agent profile `queue_run` target `primary` names."""
    ceo_agent_id: str | None
    """The agent profile `queue_run` target `workspace.ceo_agent` names."""
    priority: Literal["critical", "high", "medium", "low"]
    """Its priority."""
    wip_admitted: bool
    """False while it waits at a full step (not an entry yet)."""
    queued_for_step_id: str | None
    """The full step it waits for (at that step, or in its feeder step); None when admitted where it is."""
    workflow_version: int
    """The version of its workflow it is pinned to (`register_workflow`'s `version`): its steps, actions and
    quorum rules are that version's until `migrate_tasks` moves it to another."""


@as_result
class DecisionInfo(TypedDict):
    """A recorded decision (`list_decisions`)."""

    id: int
    """The decision's row id."""
    task_id: str
    """The task."""
    step_id: str
    """The step it is for."""
    participant_id: int | None
    """The seat it was cast from, when the decider named it."""
    role: str
    """The role recorded ("" when none could be resolved)."""
    decider_type: Literal["agent", "user"]
    """Who decided."""
    decider_id: str
    """The decider's agent profile or user id."""
    decision: Literal["approved", "rejected", "changes_requested"]
    """The verdict."""
    comment: str
    """The decider's comment."""
    created_at: str
    """When it was recorded (RFC 3339 UTC)."""


@as_result
class MarkerInfo(TypedDict):
    """The claim on one engine-owned action of a step entry."""

    position: int
    """The action's index in the step's on_enter list."""
    kind: str
    """The action type."""
    state: Literal["in_progress", "done", "skipped", "failed"]
    """in_progress while a dispatcher holds it; done, skipped or failed once it ended."""
    epoch: str | None
    """The runtime incarnation that claimed it."""
    detail: str
    """Why it was skipped or failed."""


@as_result
class StepEntryInfo(TypedDict):
    """A durable step-entry record and its markers (`list_step_entries`)."""

    task_id: str
    """The task."""
    step_id: str
    """The step entered."""
    entry_seq: int
    """The entry's number at this step (1, 2, ...)."""
    workflow_id: str
    """The workflow the step belongs to."""
    declaration_digest: str
    """A digest of the on_enter declarations the entry runs."""
    entry_path: EntryPath
    """How the step was entered (E1 ... E5)."""
    terminal: bool
    """True once every action reached a terminal marker."""
    markers: list[MarkerInfo]
    """One per claimed action, by position (an action not yet claimed has none)."""


@as_result
class OpenChild(TypedDict):
    """A child of `children_completed` that is not terminal."""

    task_id: str
    """The child."""
    state: str
    """Its state as sent."""
    workflow_id: str | None
    """The workflow it sits in, when known."""
    step_id: str | None
    """The step it sits at, when known."""


@as_result
class ParticipantInfo(TypedDict):
    """A seat (`list_participants`)."""

    participant_id: int
    """The row's id."""
    task_id: str | None
    """The task it seats; None: template-level (every task of the workflow at the step)."""
    workflow_id: str
    """Its workflow."""
    step_id: str
    """The step it is a seat of."""
    role: str
    """Its role."""
    agent_profile_id: str
    """The agent in it ('' for a seat without an agent)."""
    decision_required: bool
    """Whether its decision counts toward a quorum."""


@as_result
class ParticipantList(TypedDict):
    """`list_participants`."""

    participants: list[ParticipantInfo]
    """The task's seats and its workflow's template-level ones, in step then seat order."""


@as_result
class ParticipantAdded(TypedDict):
    """`add_participant`: the new row, or the identical one already there (adding the same seat twice is
    idempotent)."""

    participant_id: int
    """The row's id (`remove_participant` and `record_decision.participant_id` take it)."""
    already_existed: bool
    """True when an identical row (every field equal) was already seated: nothing was added."""


@as_result
class ParticipantRemoved(TypedDict):
    """`remove_participant`: the row is gone."""

    removed: Literal[True]
    """Always true."""


@as_result
class TriggerResult(TypedDict):
    """A trigger's evaluation: `turn_start`, `turn_complete` and the event triggers."""

    idempotent: bool
    """The operation id was already applied: nothing ran."""
    from_step: str | None
    """The step the task was at, when a transition was chosen."""
    to_step: str | None
    """The step a transition chose."""
    transitioned: bool
    """A transition to another step was chosen."""
    applied: bool
    """This command committed the transition."""
    operation_mark_deferred: bool
    """The operation id was left unmarked for the caller (a deferred transition)."""
    operation_id: str | None
    """The command's operation id (None for turn_start and turn_complete)."""


@as_result
class AlreadyApplied(TypedDict):
    """The command's operation id was already applied: nothing was done again."""

    idempotent: Literal[True]
    """Always true."""
    operation_id: str
    """The operation id found applied."""


@as_result
class ChildrenNotTerminal(TypedDict):
    """`children_completed` with open children: nothing ran and nothing was marked."""

    idempotent: Literal[False]
    """Always false."""
    transitioned: Literal[False]
    """Always false."""
    applied: Literal[False]
    """Always false."""
    operation_id: str
    """The operation id (unmarked: a later complete set still fires)."""
    not_terminal: Annotated[list[OpenChild], Field(min_length=1)]
    """The children still open, in row order."""


@as_result
class ChildrenCompletedResult(TypedDict):
    """`children_completed` with every child terminal: the trigger's evaluation."""

    idempotent: bool
    """The operation id was already applied: nothing ran."""
    from_step: str | None
    """The step the task was at, when a transition was chosen."""
    to_step: str | None
    """The step a transition chose."""
    transitioned: bool
    """A transition to another step was chosen."""
    applied: bool
    """This command committed the transition."""
    operation_mark_deferred: bool
    """The operation id was left unmarked for the caller (a deferred transition)."""
    operation_id: str
    """The operation id (marked once the transition, if any, committed)."""
    not_terminal: Annotated[list[OpenChild], Field(max_length=0)]
    """Always empty."""


@as_result
class MoveResult(TypedDict):
    """`move_task`, or a `switch_workflow` to where the task already is."""

    moved: bool
    """Whether the task changed step (false: it was there already, or the move was abandoned)."""
    step_id: str
    """Where the task is now."""


@as_result
class DecisionResult(TypedDict):
    """`record_decision`: whether the vote counted and what the guards did."""

    decision_id: int | None
    """The stored decision (the earlier one, for a redelivery with the same decision_id); None when nothing
    was stored: a vote for a round that is over (`not_counted_reason` says which)."""
    recorded: bool
    """False when a decision with this decision_id was already stored, or the vote's round is over."""
    role: str | None
    """The role recorded: the command's, or resolved from the seat."""
    counted: bool | None
    """Whether the vote counts towards the guards (None for a redelivery: it was said the first time)."""
    not_counted_reason: str | None
    """Why it does not count: `task_not_at_step`, `no_quorum_guard`, `no_matching_seat`, or
    `earlier_round` (its `entry_seq` is older than the step's latest entry)."""
    moved_to: str | None
    """The step a satisfied guard moved the task to."""
    guard_outcome: GuardOutcome
    """moved, quorum_not_met, move_abandoned, no_guard, or not_at_step (the task is elsewhere)."""
    operation_id: str | None
    """`decision:<task>:<step>:<decision_id>`, or None without a decision_id."""


@as_result
class TaskDeleted(TypedDict):
    """`delete_task`: the task and its rows are gone."""

    deleted: Literal[True]
    """Always true."""


@as_result
class TaskPage(TypedDict):
    """`list_tasks`: one page of tasks in task-id order."""

    tasks: list[TaskInfo]
    """The page."""
    next_after_task_id: str | None
    """Pass it as `after_task_id` for the next page; None on the last page."""


@as_result
class DecisionPage(TypedDict):
    """`list_decisions`: one page of a task's decisions in decision-id order."""

    decisions: list[DecisionInfo]
    """The page."""
    next_after_decision_id: int | None
    """Pass it as `after_decision_id` for the next page; None on the last page."""


@as_result
class StepEntryPage(TypedDict):
    """`list_step_entries`: one page of a task's step entries in (step_id, entry_seq) order."""

    entries: list[StepEntryInfo]
    """The page."""
    next_after_step_id: str | None
    """Pass it as `after_step_id` (with `next_after_entry_seq`) for the next page; None on the last page."""
    next_after_entry_seq: int | None
    """Pass it as `after_entry_seq` for the next page; None on the last page."""


@as_result
class HistoryItem(TypedDict):
    """One item of a task's history (`task_history`).

    `kind` and its `detail`:
    - `created`: `{workflow_id, workflow_version, step_id, queued}`, where the task was created;
    - `transition`: `{from_step, to_step, workflow_id, trigger, operation_id, entry_path, entry_seq,
      queued}`: the command or trigger that moved it (`move_task`, `on_turn_complete`, `record_decision`,
      `switch_workflow`, `wip_promotion`, ...), its operation id (None when it carries none), the entry
      path (E1 ... E5) and the step entry allocated (None: the step keeps no entry record, or the task
      waits `queued` at a full step);
    - `decision`: `{step_id, decision, decider_type, decider_id, role, participant_id, decision_id,
      operation_id}` as recorded (a replay records nothing);
    - `run`: `{run_id, status, agent_profile_id, step_id, ...}`, status `queued` (with `trigger`,
      `entry_seq`, `reason`), `claimed` (its latest claim's `attempt`) or how it ended (`finished`,
      `failed`, `cancelled`, with `attempt` and `outcome_reason`);
    - `migrated`: `{workflow_id, from_version, to_version, from_step, to_step, runs_kept, runs_cancelled,
      seats_moved, entry}`: a `migrate_tasks` moved it onto another version of its workflow;
    - `host_call`: a call a host connection of `onceflow serve` was made for the task, once it ended: its
      `HostCallInfo` (call_id, kind, status, attempts, host_id, latency_seconds, error, ...).
    """

    at: str
    """When, RFC 3339 UTC (the runtime's clock)."""
    kind: Literal["created", "transition", "decision", "run", "host_call", "migrated"]
    """What happened."""
    seq: int | None
    """The item's number in the task's written history (None for a `run` or `host_call` item: read from its
    own row)."""
    detail: dict[str, Any]
    """What the item says (per `kind`, above)."""


@as_result
class HistoryPage(TypedDict):
    """`task_history`: one page of a task's history, oldest first."""

    items: list[HistoryItem]
    """The page."""
    next: str | None
    """Pass it as `after` for the next page; None on the last page."""
