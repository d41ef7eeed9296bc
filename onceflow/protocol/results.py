"""What each command returns: the shape of `Reply.result` when `ok`, one typed dict (or union) per command.

Each result is a `TypedDict`: the handlers build exactly these (mypy checks every key and value), and a
reply carries them as they are, plain JSON, at no validation cost. `RESULTS` maps each command type to its
result type, `onceflow schema` prints each as JSON Schema under `results` (field descriptions from the
attribute docstrings below), docs/protocol.md lists them, and `result_of(reply)` validates a reply's result
against its type, for a host that wants it checked. The suite validates a reply of every command type
(tests/protocol/test_protocol_results.py). Pure: no thread.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal, TypeVar

from pydantic import ConfigDict, Field, GetCoreSchemaHandler, TypeAdapter
from pydantic_core import CoreSchema, core_schema
from typing_extensions import TypedDict

from onceflow.protocol.events import EntryPath, Reply
from onceflow.protocol.field_docs import attribute_docs
from onceflow.protocol.host_calls import CallKind, CallStatus, Capability
from onceflow.protocol.outcome import OutcomeEnvelope

OutcomePhase = Literal["pending", "needs-coordinator-ack", "acknowledged"]
GuardOutcome = Literal["moved", "quorum_not_met", "move_abandoned", "no_guard", "not_at_step"]
"""What a decision's guards did: moved, quorum_not_met, move_abandoned, no_guard, or not_at_step."""

R = TypeVar("R", bound=type)


class _AsEnvelope:
    """Validates JSON data as an `OutcomeEnvelope` (and documents it as one), keeping it JSON data."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(
            lambda envelope: envelope.model_dump(mode="json"), handler.generate_schema(OutcomeEnvelope)
        )


EnvelopeData = Annotated[dict[str, Any], _AsEnvelope]
"""An outcome envelope as JSON data, with `OutcomeEnvelope`'s shape and rules."""


def _result(cls: R) -> R:
    """Declare `cls` a result: unknown keys refused, and its (and its bases') attribute docstrings the
    descriptions of its JSON Schema's properties (pydantic reads them from models, not typed dicts). The
    docstrings are read when a schema is first built, never at import."""
    docs: dict[str, str] = {}

    def describe(schema: dict[str, Any]) -> None:
        if not docs:
            for klass in reversed(_lineage(cls)):
                docs.update(attribute_docs(klass))
        for name, prop in schema.get("properties", {}).items():
            if name in docs:
                prop["description"] = docs[name]

    cls.__pydantic_config__ = ConfigDict(  # type: ignore[attr-defined]
        extra="forbid", title=cls.__name__, json_schema_extra=describe
    )
    return cls


def _lineage(cls: type) -> list[type]:
    """`cls` and the typed dicts it extends, nearest first."""
    found = [cls]
    for base in getattr(cls, "__orig_bases__", ()):
        if isinstance(base, type) and base is not dict and hasattr(base, "__annotations__"):
            found.extend(_lineage(base))
    return found


# --- rows a query returns -----------------------------------------------------------------------------


@_result
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


RunStatus = Literal["queued", "claimed", "finished", "failed", "cancelled"]


@_result
class RunInfo(TypedDict):
    """A row of the runs queue (`list_runs`; `claim_run` adds its claim)."""

    id: int
    """The run id (`renew_run`, `finish_run` and `cancel_run` take it)."""
    agent_profile_id: str
    """The agent profile the run is for."""
    task_id: str | None
    """The task it is for."""
    step_id: str | None
    """The step whose action queued it."""
    trigger: str | None
    """The trigger whose action queued it (on_enter, on_comment, ...; None for runs from before it was
    kept)."""
    entry_seq: int | None
    """For an on_enter run, the step entry that queued it (with task_id and step_id)."""
    admission_seq: int | None
    """The task's admission counter when it was queued: the step entry of the task it belongs to (None: it
    belongs to no entry of its task, e.g. queued for another task)."""
    reason: str
    """Why it was queued (the action's reason, default its trigger)."""
    payload: dict[str, Any] | None
    """The action's payload (the latest one, when enqueues were coalesced into it)."""
    idempotency_key: str | None
    """The key that deduplicates it while it is unresolved and 24 hours after it resolves (None: not
    deduplicated)."""
    exclude_from_coalescing: bool
    """True when later enqueues never merge into it."""
    status: RunStatus
    """Where it is in its life."""
    coalesced_count: int
    """How many later enqueues were merged into it."""
    requested_at: str
    """When it was queued (RFC 3339 UTC, `protocol/times.py`)."""
    attempt: int
    """Claims it has had so far."""
    retries: int
    """Failed attempts retried so far."""
    lease_expires_at: str | None
    """While claimed, when the lease ends (RFC 3339 UTC)."""
    retry_at: str | None
    """While queued for a retry, when it becomes eligible (RFC 3339 UTC)."""
    superseded: bool
    """Its task has left the step entry that queued it (a claimed run's work may no longer be wanted)."""
    outcome_reason: str | None
    """Why it was failed, cancelled or queued again (run_too_old, entry_left, lease_expired, ...)."""
    last_error: str | None
    """What the host last reported when an attempt failed."""
    priority: int
    """Its priority class: 0 human, 1 recovery, 2 event (the default), 3 periodic; claims take the lowest
    class first (a run waiting longer than the policy's `aging_s` is promoted, never into 0)."""
    parent_run_id: int | None
    """The run whose work caused it (the enqueuing command's `caused_by_run_id`); None: a root."""
    causation_depth: int
    """How many runs lie between it and its chain's root (a root is 0)."""
    chain_id: int
    """Its causation chain: the root run's id (a root's own id)."""
    human_rooted: bool
    """True when its chain's root came from a command sent with `actor_kind: human` (exempt from
    `runs_per_hour`)."""
    retry_of: int | None
    """The failed or cancelled run `retry_run` queued it for."""
    result: Any
    """What the host's `finish_run` reported as the run's result (JSON, at most 64 KiB); None: none."""
    enqueue_outcome: Literal["queued", "rate_limited"]
    """`queued`, or `rate_limited`: its enqueue was refused by the limit `rate_limit` (it is kept cancelled,
    outcome_reason `rate_limited`, never handed out). Enqueues merged into it count in `coalesced_count`; a
    deduplicated enqueue makes no run (its `run_suppressed` event names this one)."""
    rate_limit: str | None
    """The limit that refused its enqueue: max_causation_depth, self_triggers, runs_per_hour,
    global_runs_per_hour; None when queued."""


@_result
class ClaimedRun(RunInfo):
    """`claim_run`: the run as claimed (status `claimed`, `lease_expires_at` set), with the claim its holder
    fences every later call with."""

    claim_token: str
    """The fencing token `renew_run` and `finish_run` take; a later claim mints another."""


@_result
class RunRenewed(TypedDict):
    """`renew_run`: the lease extended."""

    run_id: int
    """The run."""
    lease_expires_at: str
    """When the lease now ends (RFC 3339 UTC)."""
    superseded: bool
    """True when its task has left the step entry that queued it: the agent may stop."""


@_result
class RunCancelledResult(TypedDict):
    """`cancel_run`: the run is cancelled."""

    run_id: int
    """The run."""
    cancelled: bool
    """False when it was already cancelled (a no-op)."""


@_result
class RunRequeued(TypedDict):
    """`requeue_run`: the claim handed back; the run is queued again in its place in line."""

    run_id: int
    """The run."""
    status: RunStatus
    """queued."""


@_result
class RunRetried(TypedDict):
    """`retry_run`: the fresh run queued for a failed or cancelled one."""

    run_id: int
    """The new run (`retry_of` names the old one)."""
    retry_of: int
    """The run retried."""


@_result
class LimitInfo(TypedDict):
    """A limit set with `set_limits` (None: not set)."""

    scope: Literal["agent", "global"]
    """agent or global."""
    id: str | None
    """The agent profile (scope agent); None for global."""
    max_concurrent: int | None
    """The most live claims (claimed, lease not expired) at once."""
    runs_per_hour: int | None
    """The most runs queued in the last hour (runs of human-rooted chains exempt)."""


@_result
class PauseInfo(TypedDict):
    """A pause (`pause`, `list_pauses`)."""

    scope: Literal["agent", "workflow", "task", "all"]
    """What it pauses."""
    id: str | None
    """The agent profile, workflow or task; None for all."""
    reason: str
    """Why (as given)."""
    paused_at: str
    """Since when (RFC 3339 UTC)."""


@_result
class PauseResult(TypedDict):
    """`pause`: the pause in force."""

    pause: PauseInfo
    """The pause (a scope paused already keeps its first pause)."""
    created: bool
    """False when the scope was paused already (a no-op)."""


@_result
class ResumeResult(TypedDict):
    """`resume`: the pause lifted; its runs go out again in their order."""

    resumed: bool
    """False when the scope was not paused (a no-op)."""


@_result
class PauseList(TypedDict):
    """`list_pauses`: every pause, oldest first."""

    pauses: list[PauseInfo]
    """The pauses."""


@_result
class AgentQueueStats(TypedDict):
    """One agent's line of `queue_stats`."""

    agent_profile_id: str
    """The agent profile."""
    queued: int
    """Runs queued (retries waiting included)."""
    claimed: int
    """Runs claimed."""
    max_concurrent: int | None
    """Its ceiling; None: none."""
    runs_per_hour: int | None
    """Its hourly rate; None: none."""
    oldest_age_s: float | None
    """Seconds its oldest queued run has waited; None: none queued."""
    paused: bool
    """True while a pause of the agent (or of all) holds."""
    rate_limited_last_hour: int
    """Its enqueues refused in the last hour."""


@_result
class QueueStatsResult(TypedDict):
    """`queue_stats`: the queue per agent, the limits and the pauses."""

    agents: list[AgentQueueStats]
    """Per agent with an open run, a limit, a pause or a refusal in the last hour, by id."""
    limits: list[LimitInfo]
    """Every limit, global first."""
    pauses: list[PauseInfo]
    """Every pause."""
    as_of: str
    """When it was read (RFC 3339 UTC; on PostgreSQL the server's clock)."""


@_result
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


@_result
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


@_result
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


@_result
class ReviewRunInfo(TypedDict):
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
    created_at: str
    """When it was first launched (RFC 3339 UTC)."""


@_result
class OutcomeInfo(TypedDict):  # AC-CO-3
    """A coordinator outcome's durable state (`get_outcome`)."""

    outcome_id: str
    """The outcome."""
    envelope: EnvelopeData
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
    delivered_at: str | None
    """The first successful delivery (RFC 3339 UTC)."""
    acknowledged_at: str | None
    """When it was acknowledged (RFC 3339 UTC)."""
    last_delivery_error: str | None
    """local-delivery-failed, canonical-acknowledgement-failed or conflicting-outcome-ready-signal; None
    after a successful delivery."""
    acknowledged_by: str | None
    """Who acknowledged it."""
    cycle_in_flight: bool
    """True while a delivery cycle has begun and not ended."""


@_result
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


# --- what a command did ---------------------------------------------------------------------------------


@_result
class WorkflowRegistered(TypedDict):
    """`register_workflow`: the workflow's id, its steps, the version this text is, and what it means for
    the live tasks (they stay on their version until `migrate_tasks`)."""

    workflow_id: str
    """The registered workflow."""
    steps: list[str]
    """Its step ids, in position order."""
    version: int
    """The version this text is (1, 2, ...); the newest's text again is the same version."""
    changed: bool
    """False when the text was the newest version's already: nothing was stored."""
    live_tasks_by_version: dict[str, int]
    """Version (as text) -> how many tasks are pinned to it."""
    warnings: list[LintWarningInfo]
    """The template lint's warnings (`onceflow validate`), then one per step of the previous version that
    this one lacks and that holds live tasks (`step_removed`, `step_renamed`), naming it."""


@_result
class LintWarningInfo(TypedDict):
    """One warning about a template (protocol/lint.py)."""

    code: str
    """unreachable_step, no_way_out, start_on_enter, quorum_role_unseated, fan_out_without_participants,
    step_removed or step_renamed."""
    step_id: str | None
    """The step it is about."""
    message: str
    """What is wrong, naming the step."""


@_result
class WorkflowSummary(TypedDict):
    """A registered workflow in `list_workflows`."""

    workflow_id: str
    """The workflow."""
    versions: list[int]
    """Its versions, oldest first."""
    newest: int
    """Its newest version: what new tasks get."""
    live_tasks_by_version: dict[str, int]
    """Version (as text) -> how many tasks are pinned to it."""


@_result
class WorkflowList(TypedDict):
    """`list_workflows`."""

    workflows: list[WorkflowSummary]
    """Every registered workflow, by id."""


@_result
class WorkflowText(TypedDict):
    """`get_workflow`: one version as registered."""

    workflow_id: str
    """The workflow."""
    version: int
    """The version."""
    yaml: str
    """Its template text, as registered."""
    sha256: str
    """The hex SHA-256 of that text (UTF-8)."""


@_result
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


@_result
class ParticipantList(TypedDict):
    """`list_participants`."""

    participants: list[ParticipantInfo]
    """The task's seats and its workflow's template-level ones, in step then seat order."""


@_result
class TaskMigration(TypedDict):
    """One task of a `migrate_tasks` plan (or of what it did)."""

    task_id: str
    """The task."""
    from_version: int
    """The version it was on."""
    from_step: str
    """Its step there."""
    to_step: str
    """Its step in the target version."""
    runs_kept: list[int]
    """Its queued and claimed runs that move with it (their agent is still queued for by the new step)."""
    runs_cancelled: list[int]
    """Its queued and claimed runs cancelled with reason `migrated`."""
    seats_moved: int
    """Its seats (own ones, and template-level ones copied to it) moved to the new step."""
    entry: Literal["none", "closed", "entered"]
    """Its open step entry: none, closed as `migrated`, or closed and the new step entered (`enter`)."""


@_result
class MigrationResult(TypedDict):
    """`migrate_tasks`: the plan (`dry_run`) or what was done, per task."""

    workflow_id: str
    """The workflow."""
    to_version: int
    """The target version."""
    dry_run: bool
    """True: nothing was committed."""
    tasks: list[TaskMigration]
    """One per task migrated (or to migrate), in task-id order."""
    skipped: list[str]
    """Tasks named in `task_ids` already on `to_version`, or ones migrated meanwhile: left alone."""


@_result
class ParticipantAdded(TypedDict):
    """`add_participant`: the new row, or the identical one already there (adding the same seat twice is
    idempotent)."""

    participant_id: int
    """The row's id (`remove_participant` and `record_decision.participant_id` take it)."""
    already_existed: bool
    """True when an identical row (every field equal) was already seated: nothing was added."""


@_result
class ParticipantRemoved(TypedDict):
    """`remove_participant`: the row is gone."""

    removed: Literal[True]
    """Always true."""


@_result
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


@_result
class AlreadyApplied(TypedDict):
    """The command's operation id was already applied: nothing was done again."""

    idempotent: Literal[True]
    """Always true."""
    operation_id: str
    """The operation id found applied."""


@_result
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


@_result
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


@_result
class MoveResult(TypedDict):
    """`move_task`, or a `switch_workflow` to where the task already is."""

    moved: bool
    """Whether the task changed step (false: it was there already, or the move was abandoned)."""
    step_id: str
    """Where the task is now."""


@_result
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


@_result
class WorkflowSwitched(TypedDict):
    """`switch_workflow` that entered a step."""

    moved: bool
    """Whether the task changed step (false: the move was abandoned)."""
    workflow_id: str
    """The workflow switched to."""
    step_id: str
    """The step entered."""
    operation_id: str | None
    """The switch's operation id, or None without one."""


@_result
class TaskDeleted(TypedDict):
    """`delete_task`: the task and its rows are gone."""

    deleted: Literal[True]
    """Always true."""


@_result
class FinishOutcome(TypedDict):
    """`finish_run`: what the attempt's end made of the run."""

    run_id: int
    """The run."""
    status: RunStatus
    """finished; failed (for good); queued (a retry is scheduled at `retry_at`); cancelled (past its age
    limit, `run_too_old`)."""
    retry_at: str | None
    """When a scheduled retry makes it eligible again (RFC 3339 UTC)."""
    superseded: bool
    """True when its task had left the step entry that queued it."""
    replay: bool
    """True when this finish repeats the one already recorded for this claim (nothing changed)."""
    escalated_run_id: int | None
    """The `agent_error` run queued for the task's CEO agent when the run failed for good."""


@_result
class TaskPage(TypedDict):
    """`list_tasks`: one page of tasks in task-id order."""

    tasks: list[TaskInfo]
    """The page."""
    next_after_task_id: str | None
    """Pass it as `after_task_id` for the next page; None on the last page."""


@_result
class RunPage(TypedDict):
    """`list_runs`: one page of runs in run-id order."""

    runs: list[RunInfo]
    """The page."""
    next_after_run_id: int | None
    """Pass it as `after_run_id` for the next page; None on the last page."""


@_result
class DecisionPage(TypedDict):
    """`list_decisions`: one page of a task's decisions in decision-id order."""

    decisions: list[DecisionInfo]
    """The page."""
    next_after_decision_id: int | None
    """Pass it as `after_decision_id` for the next page; None on the last page."""


@_result
class StepEntryPage(TypedDict):
    """`list_step_entries`: one page of a task's step entries in (step_id, entry_seq) order."""

    entries: list[StepEntryInfo]
    """The page."""
    next_after_step_id: str | None
    """Pass it as `after_step_id` (with `next_after_entry_seq`) for the next page; None on the last page."""
    next_after_entry_seq: int | None
    """Pass it as `after_entry_seq` for the next page; None on the last page."""


@_result
class ReviewRunPage(TypedDict):
    """`list_review_runs`: one page of review runs in review-run-id order."""

    review_runs: list[ReviewRunInfo]
    """The page."""
    next_after_review_run_id: int | None
    """Pass it as `after_review_run_id` for the next page; None on the last page."""


@_result
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


@_result
class HistoryPage(TypedDict):
    """`task_history`: one page of a task's history, oldest first."""

    items: list[HistoryItem]
    """The page."""
    next: str | None
    """Pass it as `after` for the next page; None on the last page."""


@_result
class HostRegistered(TypedDict):
    """`register_host`'s result."""

    host_id: str
    """This connection's host id (`host-N`), named by the calls' records and by a refused move."""
    capabilities: list[Capability]
    """What it was registered for."""


@_result
class HostReplyTaken(TypedDict):
    """`host_reply`'s result: the answer was taken."""

    call_id: str
    """The call answered."""
    status: CallStatus
    """`answered` or `refused`."""


@_result
class HostCallError(TypedDict):
    """Why a call did not succeed."""

    code: str
    """`host_unavailable`, `host_timeout`, `cancelled`, or the host's own code (a refusal)."""
    message: str
    """What happened."""
    retryable: bool
    """Whether the same call may succeed later."""


@_result
class HostCallInfo(TypedDict):
    """One host call, as `list_host_calls` and `task_history` show it."""

    id: int | None
    """Its record's number (None while pending: it is recorded when it ends)."""
    call_id: str
    """The call's id."""
    kind: CallKind
    """What it asked."""
    task_id: str | None
    """The task it was for (None for coordinator calls)."""
    status: CallStatus
    """Where it stands."""
    attempts: int
    """How many times it was offered to a host (a host that went away before answering: offered again)."""
    host_id: str | None
    """The host that answered, or last held it."""
    created_at: str
    """When it was made, RFC 3339 UTC."""
    answered_at: str | None
    """When it ended (answered, refused, unavailable, timed out), RFC 3339 UTC; None while pending."""
    latency_seconds: float | None
    """Seconds from the call to its end (the runtime's monotonic clock); None while pending."""
    error: HostCallError | None
    """Why it did not succeed; None when answered."""


@_result
class HostCallPage(TypedDict):
    """`list_host_calls`: one page of the calls made to host connections (`onceflow serve`'s host role)."""

    calls: list[HostCallInfo]
    """The page: recorded calls in record order, then (on the last page) those still pending."""
    next_after_id: int | None
    """Pass it as `after_id` for the next page; None on the last page."""


@_result
class OutcomeReceived(TypedDict):  # AC-CO-11
    """`outcome_ready`: the outcome is recorded."""

    outcome_id: str
    """The outcome."""
    received: Literal["started", "duplicate"]
    """`started` the first time, `duplicate` for a repeat of the same envelope."""
    phase: OutcomePhase
    """Its phase now."""


@_result
class AckQueued(TypedDict):  # AC-CO-16
    """`coordinator_ack`: the acknowledgement is in the outcome's inbox."""

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
