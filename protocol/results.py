"""What each command returns: the shape of `Reply.result` when `ok`, one model (or union) per command type.

The handlers build plain dicts (validating a model per command would cost CPU on every step entry); these
models document them and check them. `RESULTS` maps each command type to its result type, `onceflow schema`
prints each as JSON Schema under `results`, docs/protocol.md lists them, and `result_of(reply)` turns a
reply's result into the model, for a Python host that wants it typed. The suite validates a reply of every
command type against these models (tests/test_protocol_results.py), so a handler that changes its shape fails
there.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from onceflow.protocol.events import EntryPath, Reply
from onceflow.protocol.outcome import OutcomeEnvelope

OutcomePhase = Literal["pending", "needs-coordinator-ack", "acknowledged"]
GuardOutcome = Literal["moved", "quorum_not_met", "move_abandoned", "no_guard", "not_at_step"]


class _Result(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


# --- rows a query returns -----------------------------------------------------------------------------


class TaskInfo(_Result):
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


class RunInfo(_Result):
    """A row of the runs queue (`claim_run`, `list_runs`)."""

    id: int
    """The run id (`finish_run` takes it)."""
    agent_profile_id: str
    """The agent profile the run is for."""
    task_id: str | None
    """The task it is for."""
    step_id: str | None
    """The step whose action queued it."""
    reason: str
    """Why it was queued (the action's reason, default its trigger)."""
    payload: dict[str, Any] | None
    """The action's payload (the latest one, when enqueues were coalesced into it)."""
    idempotency_key: str | None
    """The key that deduplicates it for 24 hours after it resolves (None: not deduplicated)."""
    exclude_from_coalescing: bool
    """True when later enqueues never merge into it."""
    status: Literal["queued", "claimed", "finished", "failed"]
    """Where it is in its life."""
    coalesced_count: int
    """How many later enqueues were merged into it."""
    requested_at: float
    """When it was queued, in Unix seconds."""


class DecisionInfo(_Result):
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
    created_at: float
    """When it was recorded, in Unix seconds."""


class MarkerInfo(_Result):
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


class StepEntryInfo(_Result):
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


class ReviewRunInfo(_Result):
    """A code-review pass started by run_code_review (`list_review_runs`)."""

    id: int
    """The review-run id, stable across a launch repeated after a crash."""
    task_id: str
    """The task reviewed."""
    step_id: str
    """The step whose entry started it."""
    entry_seq: int | None
    """The entry that started it (None for rows recorded before it was kept)."""
    position: int | None
    """The action's declared position (None for rows recorded before it was kept)."""
    agent_profile_id: str | None
    """The reviewing agent profile, if the action named one."""
    trigger: str
    """Always `workflow_step`."""
    status: Literal["started", "start_failed"]
    """`start_failed` when the host refused to start it."""
    detail: str
    """Why the start failed."""
    launches: int
    """How many times it was launched (more than 1 after a recovery re-claim)."""
    created_at: float
    """When it was first launched, in Unix seconds."""


class OutcomeInfo(_Result):
    """A coordinator outcome's durable state (`get_outcome`, AC-CO-3)."""

    outcome_id: str
    """The outcome."""
    envelope: OutcomeEnvelope
    """The envelope as received (validated)."""
    behavior_version: int
    """The rules the record runs under."""
    phase: OutcomePhase
    """pending (not delivered yet), needs-coordinator-ack (delivered) or acknowledged."""
    delivery_attempts: int
    """Delivery cycles begun, all runtimes together."""
    duplicate_signals: int
    """Repeats of `outcome_ready` with the same envelope."""
    stale_acknowledgements: int
    """Acknowledgements discarded as not matching the current delivery (store, work or fence)."""
    delivery_ref: str | None
    """The last successful delivery's reference."""
    coordinator_fence: str | None
    """The last successful delivery's coordinator fence."""
    delivered_at: float | None
    """The first successful delivery, in Unix seconds."""
    acknowledged_at: float | None
    """When it was acknowledged, in Unix seconds."""
    last_delivery_error: str | None
    """local-delivery-failed, canonical-acknowledgement-failed or conflicting-outcome-ready-signal; None
    after a successful delivery."""
    acknowledged_by: str | None
    """Who acknowledged it."""
    cycle_in_flight: bool
    """True while a delivery cycle has begun and not ended."""


class OpenChild(_Result):
    """A child of `children_completed` that is not terminal."""

    task_id: str
    """The child."""
    state: str
    """Its state as sent."""
    workflow_id: str | None
    """The workflow it sits in, when known."""
    step_id: str | None
    """The step it sits at, when known."""


# --- what a command did ---------------------------------------------------------------------------------


class WorkflowRegistered(_Result):
    """`register_workflow`: the workflow's id and its steps."""

    workflow_id: str
    """The registered workflow."""
    steps: list[str]
    """Its step ids, in position order."""


class ParticipantAdded(_Result):
    """`add_participant`: the new row."""

    participant_id: int
    """The row's id (`remove_participant` and `record_decision.participant_id` take it)."""


class ParticipantRemoved(_Result):
    """`remove_participant`: the row is gone."""

    removed: Literal[True]
    """Always true."""


class TriggerResult(_Result):
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


class AlreadyApplied(_Result):
    """The command's operation id was already applied: nothing was done again."""

    idempotent: Literal[True]
    """Always true."""
    operation_id: str
    """The operation id found applied."""


class ChildrenNotTerminal(_Result):
    """`children_completed` with open children: nothing ran and nothing was marked."""

    idempotent: Literal[False]
    """Always false."""
    transitioned: Literal[False]
    """Always false."""
    applied: Literal[False]
    """Always false."""
    operation_id: str
    """The operation id (unmarked: a later complete set still fires)."""
    not_terminal: list[OpenChild] = Field(min_length=1)
    """The children still open, in row order."""


class ChildrenCompletedResult(TriggerResult):
    """`children_completed` with every child terminal: the trigger's evaluation."""

    operation_id: str
    """The operation id (marked once the transition, if any, committed)."""
    not_terminal: list[OpenChild] = Field(max_length=0)
    """Always empty."""


class MoveResult(_Result):
    """`move_task`, or a `switch_workflow` to where the task already is."""

    moved: bool
    """Whether the task changed step (false: it was there already, or the move was abandoned)."""
    step_id: str
    """Where the task is now."""


class DecisionResult(_Result):
    """`record_decision`: whether the vote counted and what the guards did."""

    decision_id: int
    """The stored decision (the earlier one, for a redelivery with the same decision_id)."""
    recorded: bool
    """False when a decision with this decision_id was already stored."""
    role: str | None
    """The role recorded: the command's, or resolved from the seat."""
    counted: bool | None
    """Whether the vote counts towards the guards (None when nothing was recorded)."""
    not_counted_reason: str | None
    """Why it does not count."""
    moved_to: str | None
    """The step a satisfied guard moved the task to."""
    guard_outcome: GuardOutcome
    """moved, quorum_not_met, move_abandoned, no_guard, or not_at_step (the task is elsewhere)."""
    operation_id: str | None
    """`decision:<task>:<step>:<decision_id>`, or None without a decision_id."""


class WorkflowSwitched(_Result):
    """`switch_workflow` that entered a step."""

    moved: bool
    """Whether the task changed step (false: the move was abandoned)."""
    workflow_id: str
    """The workflow switched to."""
    step_id: str
    """The step entered."""
    operation_id: str | None
    """The switch's operation id, or None without one."""


class TaskDeleted(_Result):
    """`delete_task`: the task and its rows are gone."""

    deleted: Literal[True]
    """Always true."""


class RunFinished(_Result):
    """`finish_run`: the run is resolved."""

    run_id: int
    """The run."""
    status: Literal["finished", "failed"]
    """How it ended."""


class TaskPage(_Result):
    """`list_tasks`: one page of tasks in task-id order."""

    tasks: list[TaskInfo]
    """The page."""
    next_after_task_id: str | None
    """Pass it as `after_task_id` for the next page; None on the last page."""


class OutcomeReceived(_Result):
    """`outcome_ready`: the outcome is recorded (AC-CO-11)."""

    outcome_id: str
    """The outcome."""
    received: Literal["started", "duplicate"]
    """`started` the first time, `duplicate` for a repeat of the same envelope."""
    phase: OutcomePhase
    """Its phase now."""


class AckQueued(_Result):
    """`coordinator_ack`: the acknowledgement is in the outcome's inbox (AC-CO-16)."""

    outcome_id: str
    """The outcome."""
    queued: bool
    """False when the outcome was already acknowledged by the same `acknowledged_by` (a no-op)."""
    phase: OutcomePhase
    """Its phase now."""
    acknowledged_by: str | None
    """Who acknowledged it, once committed."""


RESULTS: Mapping[str, Any] = MappingProxyType(
    {
        "register_workflow": WorkflowRegistered,
        "create_task": TaskInfo,
        "add_participant": ParticipantAdded,
        "remove_participant": ParticipantRemoved,
        "turn_start": TriggerResult,
        "turn_complete": TriggerResult,
        "move_task": MoveResult,
        "record_decision": DecisionResult | AlreadyApplied,
        "switch_workflow": WorkflowSwitched | MoveResult | AlreadyApplied,
        "update_task": TaskInfo,
        "start_task": TaskInfo,
        "delete_task": TaskDeleted,
        "claim_run": RunInfo | None,
        "finish_run": RunFinished,
        "task_comment": TriggerResult,
        "blockers_resolved": TriggerResult,
        "children_completed": ChildrenCompletedResult | ChildrenNotTerminal | AlreadyApplied,
        "approval_resolved": TriggerResult,
        "agent_error": TriggerResult,
        "heartbeat": TriggerResult,
        "budget_alert": TriggerResult,
        "get_task": TaskInfo,
        "list_tasks": TaskPage,
        "list_runs": list[RunInfo],
        "list_decisions": list[DecisionInfo],
        "list_step_entries": list[StepEntryInfo],
        "list_review_runs": list[ReviewRunInfo],
        "outcome_ready": OutcomeReceived,
        "coordinator_ack": AckQueued,
        "get_outcome": OutcomeInfo,
    }
)
"""Command type -> the type of its reply's `result` when `ok` (a model, a union of models, a list, or
`X | None`). Every command type has one."""


@functools.cache
def result_adapter(command: str) -> TypeAdapter[Any]:
    """The pydantic adapter of `command`'s result type; KeyError for an unknown command type."""
    return TypeAdapter(RESULTS[command])


def result_of(reply: Reply) -> Any:
    """`reply.result` as its command's result model (a list of models for list queries; None when
    claim_run found nothing).

    Raises:
        ValueError: the reply is not `ok` (its error says why), or names no known command.
        pydantic.ValidationError: the result does not have its command's shape.
    """
    if not reply.ok:
        raise ValueError(f"{reply.command} was refused: {reply.error.code if reply.error else '?'}")
    if reply.command not in RESULTS:
        raise ValueError(f"no result type for command {reply.command!r}")
    return result_adapter(reply.command).validate_python(reply.result)


def results_schema() -> dict[str, Any]:
    """Command type -> the JSON Schema of its result (each a standalone schema with its own `$defs`)."""
    return {command: result_adapter(command).json_schema() for command in RESULTS}
