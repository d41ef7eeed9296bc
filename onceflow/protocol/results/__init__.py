"""What each command returns: the shape of `Reply.result` when `ok`, one typed dict (or union) per command.

Each result is a `TypedDict`: the handlers build exactly these (mypy checks every key and value), and a
reply carries them as they are, plain JSON, at no validation cost. `RESULTS` maps each command type to its
result type, `onceflow schema` prints each as JSON Schema under `results` (field descriptions from each
typed dict's attribute docstrings), docs/protocol.md lists them, and `result_of(reply)` validates a reply's
result against its type, for a host that wants it checked. The suite validates a reply of every command type
(tests/protocol/test_protocol_results.py). Pure: no thread.

The result types live by subject, and this module re-exports them: `task_results`, `run_results`,
`flow_results`, `workflow_results`, `host_results` and `outcome_results`, each declared with
`result_base.as_result`. Here: `RESULTS` and what reads it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pydantic import TypeAdapter

from onceflow.protocol.events import Reply
from onceflow.protocol.results.flow import (
    AgentQueueStats,
    LimitInfo,
    PauseInfo,
    PauseList,
    PauseResult,
    QueueStatsResult,
    ResumeResult,
)
from onceflow.protocol.results.hosts import (
    HostCallError,
    HostCallInfo,
    HostCallPage,
    HostRegistered,
    HostReplyTaken,
)
from onceflow.protocol.results.outcomes import (
    AckQueued,
    EnvelopeData,
    OutcomeInfo,
    OutcomePhase,
    OutcomeReceived,
)
from onceflow.protocol.results.runs import (
    ClaimedRun,
    FinishOutcome,
    ReviewRunInfo,
    ReviewRunPage,
    RunCancelledResult,
    RunInfo,
    RunPage,
    RunRenewed,
    RunRequeued,
    RunRetried,
    RunStatus,
)
from onceflow.protocol.results.tasks import (
    AlreadyApplied,
    ChildrenCompletedResult,
    ChildrenNotTerminal,
    DecisionInfo,
    DecisionPage,
    DecisionResult,
    GuardOutcome,
    HistoryItem,
    HistoryPage,
    MarkerInfo,
    MoveResult,
    OpenChild,
    ParticipantAdded,
    ParticipantInfo,
    ParticipantList,
    ParticipantRemoved,
    StepEntryInfo,
    StepEntryPage,
    TaskDeleted,
    TaskInfo,
    TaskPage,
    TriggerResult,
)
from onceflow.protocol.results.workflows import (
    LintWarningInfo,
    MigrationResult,
    TaskMigration,
    WorkflowList,
    WorkflowRegistered,
    WorkflowSummary,
    WorkflowSwitched,
    WorkflowText,
)

__all__ = [
    "RESULTS",
    "AckQueued",
    "AgentQueueStats",
    "AlreadyApplied",
    "ChildrenCompletedResult",
    "ChildrenNotTerminal",
    "ClaimedRun",
    "DecisionInfo",
    "DecisionPage",
    "DecisionResult",
    "EnvelopeData",
    "FinishOutcome",
    "GuardOutcome",
    "HistoryItem",
    "HistoryPage",
    "HostCallError",
    "HostCallInfo",
    "HostCallPage",
    "HostRegistered",
    "HostReplyTaken",
    "LimitInfo",
    "LintWarningInfo",
    "MarkerInfo",
    "MigrationResult",
    "MoveResult",
    "OpenChild",
    "OutcomeInfo",
    "OutcomePhase",
    "OutcomeReceived",
    "ParticipantAdded",
    "ParticipantInfo",
    "ParticipantList",
    "ParticipantRemoved",
    "PauseInfo",
    "PauseList",
    "PauseResult",
    "QueueStatsResult",
    "ResumeResult",
    "ReviewRunInfo",
    "ReviewRunPage",
    "RunCancelledResult",
    "RunInfo",
    "RunPage",
    "RunRenewed",
    "RunRequeued",
    "RunRetried",
    "RunStatus",
    "StepEntryInfo",
    "StepEntryPage",
    "TaskDeleted",
    "TaskInfo",
    "TaskMigration",
    "TaskPage",
    "TriggerResult",
    "WorkflowList",
    "WorkflowRegistered",
    "WorkflowSummary",
    "WorkflowSwitched",
    "WorkflowText",
    "result_adapter",
    "result_of",
    "results_schema",
]

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
        "claim_run": ClaimedRun | None,
        "renew_run": RunRenewed,
        "finish_run": FinishOutcome,
        "cancel_run": RunCancelledResult,
        "get_run": RunInfo,
        "requeue_run": RunRequeued,
        "retry_run": RunRetried,
        "set_limits": LimitInfo,
        "pause": PauseResult,
        "resume": ResumeResult,
        "list_pauses": PauseList,
        "queue_stats": QueueStatsResult,
        "task_comment": TriggerResult,
        "blockers_resolved": TriggerResult,
        "children_completed": ChildrenCompletedResult | ChildrenNotTerminal | AlreadyApplied,
        "approval_resolved": TriggerResult,
        "agent_error": TriggerResult,
        "heartbeat": TriggerResult,
        "budget_alert": TriggerResult,
        "get_task": TaskInfo,
        "list_tasks": TaskPage,
        "list_runs": RunPage,
        "list_decisions": DecisionPage,
        "list_step_entries": StepEntryPage,
        "list_review_runs": ReviewRunPage,
        "task_history": HistoryPage,
        "list_host_calls": HostCallPage,
        "migrate_tasks": MigrationResult | AlreadyApplied,
        "list_workflows": WorkflowList,
        "get_workflow": WorkflowText,
        "list_participants": ParticipantList,
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
    """`reply.result`, validated against its command's result type (a typed dict; a list of them for list
    queries; None when claim_run found nothing).

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
