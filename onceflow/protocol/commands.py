"""Commands a host sends to the runtime, as pydantic v2 models discriminated on `type`. Pure: the wire, no
thread.

Every command is one JSON object on the wire (see `codec.py`). Unknown fields are rejected so a typo in a
host never silently does nothing. Identifiers are non-empty strings; a time is RFC 3339 UTC text, as in
results and events (`times.py`), and a command's time also accepts a number of Unix seconds.
Every field is bounded (`limits.py`, shown by `onceflow schema`): ids at most MAX_ID_CHARS characters without
control characters, free text MAX_TEXT_CHARS, integers int64, lists MAX_LIST_ITEMS; a string holding a lone
surrogate is not valid Unicode and is refused. Operation-id shapes follow operation-ledger-lifetime.md.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeGuard, cast, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from onceflow.protocol.causation import Causation
from onceflow.protocol.field_docs import describe_fields
from onceflow.protocol.host_calls import CallKind, CallStatus
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
from onceflow.protocol.times import Instant, WholeInstant
from onceflow.protocol.tracecontext import TraceContext

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]
"""A required identifier."""
Name = Annotated[str, Field(max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]
"""An optional identifier or short name, where empty means "none" (as `agent_profile_id: ""`)."""
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
"""Free text: a title or a comment."""
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
HISTORY_CURSOR = r"^-?[0-9][0-9.e+-]*:[0-4]:[0-9]+$"
"""A `task_history` cursor: `<time>:<rank>:<key>`, as a page's `next` gives it."""
Role = Literal["reviewer", "approver", "watcher", "collaborator", "runner"]
Priority = Literal["critical", "high", "medium", "low"]


class _Model(BaseModel):
    # Field docstrings are the descriptions `onceflow schema` and docs/protocol.md show.
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=describe_fields)


class _Command(_Model, TraceContext, Causation):
    """A command: its own fields, and the trace context (`tracecontext.py`) and causation (`causation.py`)
    every command may carry."""


class RegisterWorkflow(_Command):
    """Register (or replace) a workflow from template YAML text; `source` names it in errors."""

    type: Literal["register_workflow"] = "register_workflow"
    """The command name."""
    yaml: Annotated[str, Field(max_length=MAX_TEMPLATE_BYTES)]
    """The template, as YAML text (the workflow template format; `onceflow schema --template` is its JSON
    Schema)."""
    source: Annotated[str, Field(min_length=1, max_length=MAX_SOURCE_CHARS, pattern=ID_PATTERN)] = (
        "<protocol>"
    )
    """A label for the template (usually its path); errors name it."""
    import_path: bool = False
    """Accept the import path's extra action types (run_code_review and configure_session under on_enter,
    transitions under the event triggers); templates otherwise get the strict allow-lists."""


class CreateTask(_Command):
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


class AddParticipant(_Command):
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


class RemoveParticipant(_Command):
    """Remove a participant row (`not_found` when there is none)."""

    type: Literal["remove_participant"] = "remove_participant"
    """The command name."""
    participant_id: Int64
    """The row's id, as `add_participant` returned it."""


class TurnStart(_Command):
    """The task's agent started a turn: fires on_turn_start."""

    type: Literal["turn_start"] = "turn_start"
    """The command name."""
    task_id: Id
    """The task whose agent started a turn."""


class TurnComplete(_Command):
    """The task's agent finished a turn: fires on_turn_complete (entry path E1 on a transition)."""

    type: Literal["turn_complete"] = "turn_complete"
    """The command name."""
    task_id: Id
    """The task whose agent finished a turn."""


class MoveTask(_Command):
    """Manual move (entry path E2). A move to the task's current step is not an entry and does nothing."""

    type: Literal["move_task"] = "move_task"
    """The command name."""
    task_id: Id
    """The task to move."""
    step_id: Id
    """The step to move it to, in its current workflow."""


class RecordDecision(_Command):
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


class SwitchWorkflow(_Command):
    """Move the task into another workflow at `step_id` (default: its start step): entry path E4."""

    type: Literal["switch_workflow"] = "switch_workflow"
    """The command name."""
    task_id: Id
    """The task to move."""
    workflow_id: Id
    """The registered workflow it moves into."""
    step_id: Name | None = None
    """The step it lands at; None: the workflow's start step."""
    operation_id: Name | None = None
    """The host's id of this switch: a redelivery with the same id does nothing (`idempotent`)."""


class UpdateTask(_Command):
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


class StartTask(_Command):
    """Start the task (optionally attaching a session); a step change is entry path E5."""

    type: Literal["start_task"] = "start_task"
    """The command name."""
    task_id: Id
    """The task to start."""
    step_id: Name | None = None
    """A step to move to (entry path E5); None: stay."""
    session_id: Name | None = None
    """A session to attach; None leaves it."""


class DeleteTask(_Command):
    """Delete the task and its rows; a WIP slot it held is freed, admitting a queued task (E3)."""

    type: Literal["delete_task"] = "delete_task"
    """The command name."""
    task_id: Id
    """The task to delete."""


Seconds = Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)]
"""A duration in seconds, finite and positive, at most a day."""


class ClaimRun(_Command):
    """Claim the next eligible run of an agent profile, of any of several, or of any agent (reply result: the
    run with its `claim_token` and lease, or null): a queued run whose retry time has come, or a claimed one
    whose lease expired; the lowest priority class first (after aging), then the oldest; across several
    agents, the least recently served agent first within a class. Each claim mints a new `claim_token` (the
    fencing token `renew_run` and `finish_run` take) and counts an attempt. A run past its age limit is
    cancelled on the way (`run_cancelled`, reason `run_too_old`), never handed out; a run of a step entry
    its task has left was cancelled when it left (`entry_left`). Runs of agents at their `max_concurrent`
    ceiling (or with the global one reached), and paused runs, are not handed out: a null result then comes
    with a `run_claim_held` event in the reply saying why (`at_capacity` with the limit, or `paused`)."""

    type: Literal["claim_run"] = "claim_run"
    """The command name."""
    agent_profile_id: Id | None = None
    """The agent profile claiming work (or `agent_profile_ids`; neither: any agent)."""
    agent_profile_ids: Annotated[list[Id], Field(min_length=1, max_length=MAX_LIST_ITEMS)] | None = None
    """Claim for any of these agent profiles, fairly (not with `agent_profile_id`)."""
    lease_seconds: Seconds | None = None
    """How long the claim holds before the run returns to the queue unless renewed; None: the runtime's
    `RunPolicy.lease` (at most its `max_lease`)."""
    wait_seconds: Annotated[float, Field(ge=0, le=60, allow_inf_nan=False)] = 0
    """When no run is eligible, wait up to this many seconds for one (a long poll; no busy polling) before
    answering null. A wait that is cancelled (the client went away) claims nothing."""

    @model_validator(mode="after")
    def _one_agent_field(self) -> ClaimRun:
        if self.agent_profile_id is not None and self.agent_profile_ids is not None:
            raise ValueError("send agent_profile_id or agent_profile_ids, not both")
        return self

    def agents(self) -> list[str] | None:
        """The agent profiles claimed for (None: any), without repeats, in the order given."""
        if self.agent_profile_id is not None:
            return [self.agent_profile_id]
        return None if self.agent_profile_ids is None else list(dict.fromkeys(self.agent_profile_ids))


class RenewRun(_Command):
    """Extend a claim's lease: a compare-and-set on the current `claim_token` (a stale token, after the
    lease expired and the run was claimed again, or after it was cancelled, is a `conflict` naming
    `claim_token`, and changes nothing)."""

    type: Literal["renew_run"] = "renew_run"
    """The command name."""
    run_id: Int64
    """The claimed run."""
    claim_token: Id
    """The token its claim returned."""
    lease_seconds: Seconds | None = None
    """The new lease from now; None: the runtime's `RunPolicy.lease`."""


MAX_RESULT_BYTES = 64 * 1024
"""The most bytes of canonical JSON a run's `result` may take."""


def _json_result(value: Any) -> Any:
    if value is None:
        return None
    try:
        encoded = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"must be JSON (string keys, no NaN or infinity): {exc}") from None
    if len(encoded) > MAX_RESULT_BYTES:
        raise ValueError(f"encodes to {len(encoded)} bytes of JSON; the limit is {MAX_RESULT_BYTES}")
    return value


class FinishRun(_Command):
    """Resolve a claimed run: a compare-and-set on the current `claim_token`. `finished` ends it; `failed`
    with `retryable` and retries left queues it again for later (`run_retry_scheduled`: backoff, or
    `retry_at` when the host knows when, e.g. a rate limit's reset), else fails it for good (`run_failed`),
    queuing an `agent_error` run for the task's CEO agent when it has one. The same finish again with the
    same token is an idempotent replay, also when both are sent at once; a stale token is a `conflict` naming
    `claim_token`. Without a token a claimed run's finish is refused `fence_required` (field
    `claim_token`) unless `unfenced` is true: then it resolves whichever claim holds the run (deprecated)."""

    type: Literal["finish_run"] = "finish_run"
    """The command name."""
    run_id: Int64
    """The claimed run."""
    status: Literal["finished", "failed"] = "finished"
    """How the attempt ended."""
    claim_token: Id | None = None
    """The token its claim returned (None: refused `fence_required`, unless `unfenced`)."""
    unfenced: bool = False
    """True, without a `claim_token`: resolve the run's current claim whoever holds it (the explicit opt-out
    of fencing; a late host may then end another host's claim). Never with a `claim_token`."""
    error: Text | None = None
    """Why it failed (kept as the run's `last_error`)."""
    retryable: bool = True
    """False: a failure retrying cannot cure (the agent's own); the run fails at once."""
    retry_at: Instant | None = None
    """When to retry, instead of the backoff (a rate limit's reset time): RFC 3339 UTC, or a number of Unix
    seconds."""
    result: Annotated[Any, AfterValidator(_json_result)] = None
    """What the run produced (any JSON, at most 64 KiB as canonical JSON): stored with the run, returned by
    `get_run` and `list_runs`, pruned with it. None: nothing stored."""

    @field_validator("unfenced")
    @classmethod
    def _fence(cls, unfenced: bool, info: ValidationInfo) -> bool:
        if unfenced and info.data.get("claim_token") is not None:
            raise ValueError(
                "true only without a claim_token (the opt-out of fencing): send one or the other"
            )
        return unfenced


class CancelRun(_Command):
    """Cancel a queued or claimed run (a compare-and-set on its status, `run_cancelled`); a claimed one's
    holder then gets a `conflict` naming `claim_token` from `renew_run` and `finish_run`. Cancelling a
    finished or failed run is a `conflict` naming `run_id`; cancelling a cancelled one is a no-op."""

    type: Literal["cancel_run"] = "cancel_run"
    """The command name."""
    run_id: Int64
    """The run."""
    reason: Name = "cancelled_by_host"
    """Why (the `run_cancelled` event carries it)."""


class GetRun(_Command):
    """One run as `list_runs` shows it (its stored `result` included); `not_found` naming `run_id` when there
    is none (or it was pruned)."""

    type: Literal["get_run"] = "get_run"
    """The command name."""
    run_id: Int64
    """The run."""


class RequeueRun(_Command):
    """Hand a claimed run back to the queue (a compare-and-set on the current `claim_token`): queued again in
    its place in line (its attempt counted), for any claimer; a stale token is a `conflict` naming
    `claim_token`. `run_requeued` says so."""

    type: Literal["requeue_run"] = "requeue_run"
    """The command name."""
    run_id: Int64
    """The claimed run."""
    claim_token: Id
    """The token its claim returned."""


class RetryRun(_Command):
    """Queue a fresh run for a failed or cancelled one (also one refused `rate_limited`: an operator's retry
    passes the limits): same agent, task, step, reason and payload, priority at most 1 (recovery), in the
    same causation chain, linked by `retry_of`. Any other status is a `conflict` naming `run_id`."""

    type: Literal["retry_run"] = "retry_run"
    """The command name."""
    run_id: Int64
    """The failed or cancelled run."""


Count = Annotated[int, Field(ge=1, le=1_000_000, strict=True)]
"""A positive integer limit (sent as a JSON number; 0 is refused: pausing is how to stop)."""


class SetLimits(_Command):
    """Set an agent profile's (or the global) flow limits; a limit left out is kept, `null` removes it.
    `max_concurrent`: the most live claims at once (claimed, lease not expired), checked in the claim's
    own transaction on every runtime; `runs_per_hour`: the most runs queued in the last hour (runs of
    human-rooted chains exempt; an enqueue past it is `rate_limited`). Limits are durable."""

    type: Literal["set_limits"] = "set_limits"
    """The command name."""
    scope: Literal["agent", "global"]
    """agent (with `id`) or global (without)."""
    id: Id | None = None
    """The agent profile (scope agent only)."""
    max_concurrent: Count | None = None
    """The ceiling of live claims (1..1000000; null: none)."""
    runs_per_hour: Count | None = None
    """The hourly rate of new runs (1..1000000; null: none)."""

    @model_validator(mode="after")
    def _scoped(self) -> SetLimits:
        if (self.scope == "agent") != (self.id is not None):
            raise ValueError("id is required for scope agent and refused for scope global")
        return self


PauseScope = Literal["agent", "workflow", "task", "all"]


class _Scoped(_Command):
    scope: PauseScope
    """agent, workflow or task (with `id`), or all (without)."""
    id: Id | None = None
    """The agent profile, workflow or task (not for all)."""

    @model_validator(mode="after")
    def _scoped(self) -> _Scoped:
        if (self.scope == "all") != (self.id is None):
            raise ValueError("id is required for scopes agent, workflow and task, and refused for all")
        return self


class Pause(_Scoped):
    """Stop handing out the scope's runs (claims answer null with `run_claim_held`, reason `paused`); they
    keep queueing and keep their order. Durable, and on PostgreSQL held by every runtime."""

    type: Literal["pause"] = "pause"
    """The command name."""
    reason: Text = ""
    """Why (shown by `list_pauses` and `onceflow queue`)."""


class Resume(_Scoped):
    """Lift the scope's pause: its runs go out again in their order (another pause covering them still
    holds)."""

    type: Literal["resume"] = "resume"
    """The command name."""


class ListPauses(_Command):
    """Every pause in force, oldest first."""

    type: Literal["list_pauses"] = "list_pauses"
    """The command name."""


class QueueStats(_Command):
    """The queue per agent (queued, claimed, ceiling, oldest age, paused, rate-limited in the last hour),
    the limits and the pauses (what `onceflow queue` shows)."""

    type: Literal["queue_stats"] = "queue_stats"
    """The command name."""


# --- event triggers: each carries what its operation id is built from -----------------------------


class TaskComment(_Command):
    """on_comment; operation id `task_comment:<comment_id>`."""

    type: Literal["task_comment"] = "task_comment"
    """The command name."""
    task_id: Id
    """The task commented on."""
    comment_id: Id
    """The comment's id: a redelivery with the same id is idempotent."""


class BlockersResolved(_Command):
    """on_blocker_resolved; operation id `blockers_resolved:<task>`."""

    type: Literal["blockers_resolved"] = "blockers_resolved"
    """The command name."""
    task_id: Id
    """The task whose blockers are resolved."""


class ChildRow(_Model):
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


class ChildrenCompleted(_Command):
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


class ApprovalResolved(_Command):
    """on_approval_resolved; operation id `approval_resolved:<approval_id>`."""

    type: Literal["approval_resolved"] = "approval_resolved"
    """The command name."""
    task_id: Id
    """The task the approval was for."""
    approval_id: Id
    """The approval's id: a redelivery with the same id is idempotent."""


class AgentError(_Command):
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


class Heartbeat(_Command):
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


class BudgetAlert(_Command):
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


# --- queries ----------------------------------------------------------------------------------------


class GetTask(_Command):
    """The task's current row."""

    type: Literal["get_task"] = "get_task"
    """The command name."""
    task_id: Id
    """The task."""


class ListTasks(_Command):
    """A page of tasks in task-id order: those after `after_task_id` (exclusive; None = from the first), at
    most `limit` (1..1000, default 100). Result `{tasks: [get_task shape...], next_after_task_id}`, the
    latter None on the last page, else the value to pass for the next one."""

    type: Literal["list_tasks"] = "list_tasks"
    """The command name."""
    after_task_id: Name | None = None
    """Start after this task id (exclusive); None: from the first task."""
    limit: int = Field(default=100, ge=1, le=1000)
    """At most this many tasks in the page."""


Limit = Annotated[int, Field(ge=1, le=1000)]
"""How many rows one page of a `list_*` query holds at most (1..1000)."""


class ListRuns(_Command):
    """A page of the runs queue in run-id order (oldest first), filtered by every field given: those after
    `after_run_id` (exclusive; None = from the first), at most `limit` (1..1000, default 100). Result
    `{runs: [run...], next_after_run_id}`, the latter None on the last page, else the value to pass for the
    next one. A page costs the same however long the history (keyed by run id)."""

    type: Literal["list_runs"] = "list_runs"
    """The command name."""
    task_id: Name | None = None
    """Only this task's runs."""
    agent_profile_id: Name | None = None
    """Only runs for this agent profile."""
    status: Literal["queued", "claimed", "finished", "failed", "cancelled"] | None = None
    """Only runs in this status."""
    after_run_id: Int64 | None = None
    """Start after this run id (exclusive); None: from the first run."""
    limit: Limit = 100
    """At most this many runs in the page."""


class ListDecisions(_Command):
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


class ListStepEntries(_Command):
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


class TaskHistory(_Command):
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


class ListReviewRuns(_Command):
    """A page of the code-review passes started by run_code_review (of one task, or all) in review-run-id
    order: each with its review-run id and entry identity, so a host can tell a launch repeated after a
    crash from a new entry's. Those after `after_review_run_id` (exclusive; None = from the first), at most
    `limit` (1..1000, default 100). Result `{review_runs: [...], next_after_review_run_id}` (None on the
    last page).
    """

    type: Literal["list_review_runs"] = "list_review_runs"
    """The command name."""
    task_id: Name | None = None
    """Only this task's review runs."""
    after_review_run_id: Int64 | None = None
    """Start after this review-run id (exclusive); None: from the first."""
    limit: Limit = 100
    """At most this many review runs in the page."""


class ListHostCalls(_Command):
    """A page of the calls made to host connections of `onceflow serve` (its host role), filtered by every
    field given: the recorded ones (each ended: answered, refused, unavailable, timed out, cancelled) in
    record order after `after_id` (exclusive; None = from the first), at most `limit`; the last page also
    lists the calls still pending (`id` None), oldest first. Result `{calls: [...], next_after_id}`, the
    latter None on the last page. Over a runtime without host connections it lists nothing."""

    type: Literal["list_host_calls"] = "list_host_calls"
    """The command name."""
    status: CallStatus | None = None
    """Only calls in this status (`pending`: only those still waiting)."""
    task_id: Name | None = None
    """Only this task's calls."""
    kind: CallKind | None = None
    """Only calls of this kind."""
    after_id: Int64 | None = None
    """Start after this record id (exclusive); None: from the first."""
    limit: Limit = 100
    """At most this many recorded calls in the page."""


class MigrateTasks(_Command):
    """Move the live tasks of a workflow onto version `to_version` of it. Validated first: every task's step
    must map to a step of that version (`step_map`, else the same id when the version still has it), or
    nothing is done and the error names the unmapped steps and tasks. `dry_run` answers the plan without
    committing. Else each task is migrated in its own transaction: its runs of the mapped step whose agent
    the new step still queues for are kept (moved with it), the others cancelled (`migrated`); its seats and
    the round's decisions move with their step; an open step entry is closed as `migrated` with no second
    fan-out, unless `enter` asks for the new step's on_enter (a new entry, path E4). A task already on
    `to_version` is left alone, so a replay (or a retry after a crash) changes nothing it did. Result
    `{workflow_id, to_version, dry_run, tasks: [{task_id, from_version, from_step, to_step, runs_kept,
    runs_cancelled, seats_moved, entry}], skipped}`."""

    type: Literal["migrate_tasks"] = "migrate_tasks"
    """The command name."""
    workflow_id: Id
    """The workflow whose tasks move."""
    to_version: Annotated[int, Field(ge=1, le=INT64_MAX)]
    """The registered version they move to (`register_workflow`'s `version`)."""
    step_map: Annotated[dict[Id, Id], Field(max_length=MAX_LIST_ITEMS)] = Field(default_factory=dict)
    """Old step id -> step id of `to_version`; a step `to_version` still has maps to itself unless mapped."""
    task_ids: Annotated[list[Id], Field(max_length=MAX_LIST_ITEMS)] | None = None
    """Only these tasks (each must be a task of the workflow); None: every task not on `to_version`."""
    dry_run: bool = False
    """Answer the plan, commit nothing."""
    enter: bool = False
    """Run the new step's on_enter for each migrated task whose step entry was open (path E4)."""
    operation_id: Name | None = None
    """An operation id: once the whole migration applied, a replay answers `idempotent`."""


class ListWorkflows(_Command):
    """Every registered workflow: `{workflows: [{workflow_id, versions, newest, live_tasks_by_version}]}`
    (`live_tasks_by_version`: version as text -> how many tasks are pinned to it)."""

    type: Literal["list_workflows"] = "list_workflows"
    """The command name."""


class GetWorkflow(_Command):
    """One version of a workflow as registered: `{workflow_id, version, yaml, sha256}`."""

    type: Literal["get_workflow"] = "get_workflow"
    """The command name."""
    workflow_id: Id
    """A registered workflow."""
    version: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    """Its version; None: the newest."""


class ListParticipants(_Command):
    """The seats of a task: `{participants: [{participant_id, task_id, workflow_id, step_id, role,
    agent_profile_id, decision_required}]}`, its own and the template-level ones of its workflow (task_id
    None), in step then seat order."""

    type: Literal["list_participants"] = "list_participants"
    """The command name."""
    task_id: Id
    """The task."""


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
