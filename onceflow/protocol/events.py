"""Events the runtime emits, and the reply to each command, as pydantic v2 models discriminated on `type`.
Pure: the wire, no thread.

Events describe committed facts (a transition, a queued run) or requests to the host (session_action);
`diagnostic` carries a log-worthy condition with its identifying fields as discrete keys.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from onceflow.protocol.errors import RefusedError
from onceflow.protocol.field_docs import describe_fields

EntryPath = Literal["E1", "E2", "E3", "E4", "E5", "recovery"]


class _Event(BaseModel):
    # Field docstrings are the descriptions `onceflow schema` and docs/protocol.md show.
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=describe_fields)


class TaskCreated(_Event):
    """A task was created (committed). Creation is not a step entry: no on_enter runs."""

    type: Literal["task_created"] = "task_created"
    """The event name."""
    task_id: str
    """The new task."""
    workflow_id: str
    """Its workflow."""
    step_id: str
    """The step it was placed at (a feeder step when its target was full)."""


class Transition(_Event):
    """The task's step changed (committed). `trigger` is what caused it (a trigger name or a command)."""

    type: Literal["transition"] = "transition"
    """The event name."""
    task_id: str
    """The task that moved."""
    workflow_id: str
    """The workflow it is in after the move."""
    from_step: str
    """The step it left."""
    to_step: str
    """The step it entered."""
    trigger: str
    """What caused the move: a trigger (`on_turn_complete`) or a command (`move_task`, `record_decision`)."""


class StepEntered(_Event):
    """A step entry was admitted; `entry_seq` is None when on_enter declares no engine-owned action."""

    type: Literal["step_entered"] = "step_entered"
    """The event name."""
    task_id: str
    """The task."""
    step_id: str
    """The step entered."""
    entry_seq: int | None
    """The entry's sequence number at this step (1, 2, ...); None when no step-entry record is allocated."""
    entry_path: EntryPath
    """How it was entered: E1 transition, E2 manual move, E3 WIP promotion, E4 switch_workflow, E5 task
    update/start, or `recovery` (an open entry finished by the start-up scan)."""


class TaskQueued(_Event):
    """The task landed at a full step without being admitted (a queued placement: not an entry)."""

    type: Literal["task_queued"] = "task_queued"
    """The event name."""
    task_id: str
    """The task."""
    step_id: str
    """The full step it waits at; a WIP promotion admits it later (entry path E3)."""


class GuardEvaluated(_Event):
    """A quorum guard of a transition was evaluated against the step's seats and decisions."""

    type: Literal["guard_evaluated"] = "guard_evaluated"
    """The event name."""
    task_id: str
    """The task."""
    step_id: str
    """The step whose transition is guarded."""
    target_step: str
    """Where the transition leads."""
    role: str
    """The role whose seats are counted."""
    threshold: str
    """all_approve, all_decide, majority_approve, any_reject or n_approve:N."""
    satisfied: bool
    """Whether the transition may happen."""
    seats: int
    """Seats of the role at the step."""
    approvals: int
    """Seats whose latest decision is `approved`."""
    reason: str
    """no_seats (fails closed), unsatisfiable (n_approve:N with N > seats), pending, approved, decided or
    vetoed."""


class ActionOutcome(_Event):
    """An action reached its dispatcher. outcome: done | skipped | failed | abandoned | already_done."""

    type: Literal["action_outcome"] = "action_outcome"
    """The event name."""
    task_id: str
    """The task."""
    step_id: str
    """The step declaring the action."""
    trigger: str
    """The trigger it is declared under."""
    position: int
    """Its index in that trigger's list."""
    kind: str
    """The action type (`queue_run`, `clear_decisions`, ...)."""
    outcome: str
    """done, skipped, failed, abandoned or already_done (a marker said so: not run again)."""
    detail: str = ""
    """Why, when it did not simply succeed."""


class RunQueued(_Event):
    """A run was added to the runs queue (committed)."""

    type: Literal["run_queued"] = "run_queued"
    """The event name."""
    run_id: int
    """The new run; `claim_run` hands it out."""
    task_id: str | None
    """The task it is for."""
    step_id: str | None
    """The step whose action queued it."""
    agent_profile_id: str
    """The agent profile it is queued for."""
    reason: str
    """The action's `reason` (default: the trigger's name)."""
    idempotency_key: str | None
    """The key that deduplicates it for 24 hours after it resolves (None: not deduplicated)."""
    outcome: Literal["queued"] = "queued"
    """The enqueue's outcome (every enqueue event carries one: queued, deduped, coalesced, rate_limited)."""
    priority: int = 2
    """Its priority class (0 human, 1 recovery, 2 event, 3 periodic)."""
    parent_run_id: int | None = None
    """The run that caused it (None: a root)."""
    causation_depth: int = 0
    """Its depth in its causation chain (a root is 0)."""


class RunSuppressed(_Event):
    """An enqueue hit an idempotency key still honoured (its run unresolved, or resolved less than 24 h ago):
    a success that changed nothing. `existing_run_id` is the run the key produced or was merged into."""

    type: Literal["run_suppressed"] = "run_suppressed"
    """The event name."""
    existing_run_id: int
    """The run the key produced or was merged into."""
    task_id: str | None
    """The task the enqueue was for."""
    agent_profile_id: str
    """The agent profile the enqueue was for."""
    reason: str
    """The enqueue's reason."""
    idempotency_key: str
    """The honoured key."""
    outcome: Literal["deduped"] = "deduped"
    """The enqueue's outcome: deduped."""


class RunCoalesced(_Event):
    """An enqueue merged into a queued run of the same task, agent and reason from the last 5 s."""

    type: Literal["run_coalesced"] = "run_coalesced"
    """The event name."""
    run_id: int
    """The queued run it merged into."""
    task_id: str | None
    """The task."""
    agent_profile_id: str
    """The agent profile."""
    reason: str
    """The shared reason."""
    coalesced_count: int
    """How many enqueues the run now stands for, beyond the first."""
    outcome: Literal["coalesced"] = "coalesced"
    """The enqueue's outcome: coalesced."""


class RunRateLimited(_Event):
    """An enqueue was refused by a flow limit (committed): no run will do it. It is kept as a cancelled run
    (`run_id`, outcome_reason `rate_limited`) for `list_runs` and `queue_stats`; its idempotency key was not
    used, so the same enqueue goes through once the limit allows. `retry_run` queues it anyway."""

    type: Literal["run_rate_limited"] = "run_rate_limited"
    """The event name."""
    run_id: int
    """The refused run (cancelled)."""
    task_id: str | None
    """The task the enqueue was for."""
    agent_profile_id: str
    """The agent profile the enqueue was for."""
    reason: str
    """The enqueue's reason."""
    outcome: Literal["rate_limited"] = "rate_limited"
    """The enqueue's outcome: rate_limited."""
    limit: str
    """The limit that refused it: max_causation_depth (the chain would be deeper), self_triggers (a fourth
    run of one agent for one reason, caused by its own runs, in one chain), runs_per_hour (the agent's), or
    global_runs_per_hour."""
    limit_value: int
    """The limit's value."""
    parent_run_id: int | None
    """The run that caused the enqueue."""
    causation_depth: int
    """The depth the run would have had."""


class RunClaimHeld(_Event):
    """A claim found eligible runs but handed none out (in the `claim_run` reply only, never broadcast): the
    agents are at their ceiling or the global one is reached (`at_capacity`), or the runs are paused."""

    type: Literal["run_claim_held"] = "run_claim_held"
    """The event name."""
    reason: Literal["at_capacity", "paused"]
    """Why no run was handed out."""
    limit_scope: Literal["agent", "global"] | None = None
    """For at_capacity: whose ceiling (None for paused)."""
    limit_id: str | None = None
    """For an agent's ceiling: the agent profile."""
    max_concurrent: int | None = None
    """For at_capacity: the ceiling."""


class RunRequeued(_Event):
    """A host handed a claimed run back (`requeue_run`, committed): queued again in its place in line."""

    type: Literal["run_requeued"] = "run_requeued"
    """The event name."""
    run_id: int
    """The run."""
    task_id: str | None
    """The task it is for."""
    agent_profile_id: str
    """The agent profile it is for."""
    attempt: int
    """Claims it has had so far."""


class FlowChanged(_Event):
    """Flow control changed (committed): `set_limits`, `pause` or `resume` took effect."""

    type: Literal["flow_changed"] = "flow_changed"
    """The event name."""
    change: Literal["limits_set", "paused", "resumed"]
    """What changed."""
    scope: str
    """The scope: agent or global (limits); agent, workflow, task or all (pauses)."""
    id: str | None
    """The agent profile, workflow or task (None: global or all)."""
    max_concurrent: int | None = None
    """limits_set: the ceiling now (None: none)."""
    runs_per_hour: int | None = None
    """limits_set: the hourly rate now (None: none)."""
    reason: str | None = None
    """paused: why."""


class _RunChange(_Event):
    run_id: int
    """The run."""
    task_id: str | None
    """The task it is for."""
    agent_profile_id: str
    """The agent profile it is for."""
    attempt: int
    """Claims it has had so far."""


class RunClaimed(_RunChange):
    """A host claimed a run (committed): it holds it until `lease_expires_at` unless it renews."""

    type: Literal["run_claimed"] = "run_claimed"
    """The event name."""
    lease_expires_at: str
    """When the lease ends (RFC 3339 UTC, `protocol/times.py`)."""


class RunFinished(_RunChange):
    """A run finished (committed)."""

    type: Literal["run_finished"] = "run_finished"
    """The event name."""
    superseded: bool
    """True when its step entry had been left meanwhile (its work may no longer be wanted)."""


class RunRetryScheduled(_RunChange):
    """A failed attempt will be retried (committed): the run is queued again, eligible from `retry_at`."""

    type: Literal["run_retry_scheduled"] = "run_retry_scheduled"
    """The event name."""
    retry_at: str
    """When it may be claimed again (RFC 3339 UTC; the backoff, or the host's `retry_at`)."""
    retries: int
    """Failed attempts retried so far, this one included."""
    error: str | None
    """What the host reported."""


class RunFailed(_RunChange):
    """A run failed for good (committed)."""

    type: Literal["run_failed"] = "run_failed"
    """The event name."""
    reason: str
    """not_retryable (the host said so), retries_exhausted, or too_many_attempts (leases kept expiring)."""
    error: str | None
    """What the host last reported."""
    escalated_run_id: int | None
    """The `agent_error` run queued for the task's CEO agent, if it has one."""


class RunCancelled(_RunChange):
    """A queued or claimed run was cancelled (committed); it is never handed out again."""

    type: Literal["run_cancelled"] = "run_cancelled"
    """The event name."""
    reason: str
    """entry_left (its task left the step entry that queued it: Kandev's workflow_step_changed, applied at
    once), run_too_old (past the age limit), task_deleted, or the host's reason (`cancel_run`)."""


class RunLeaseExpired(_RunChange):
    """A claimed run's lease ran out (committed): it is queued again for another claim."""

    type: Literal["run_lease_expired"] = "run_lease_expired"
    """The event name."""


class DecisionRecorded(_Event):
    """A decision was stored. `role` is the one recorded: the command's, or resolved from the seat."""

    type: Literal["decision_recorded"] = "decision_recorded"
    """The event name."""
    decision_id: int
    """The stored decision's row id."""
    task_id: str
    """The task."""
    step_id: str
    """The step it is for."""
    decider_id: str
    """Who decided."""
    decision: str
    """approved, rejected or changes_requested."""
    role: str = ""
    """The role recorded ("" when none could be resolved)."""


class DecisionsCleared(_Event):
    """A clear_decisions action deleted the decisions of a step (a new review round)."""

    type: Literal["decisions_cleared"] = "decisions_cleared"
    """The event name."""
    task_id: str
    """The task."""
    step_id: str
    """The step whose decisions were deleted."""
    deleted: int
    """How many were deleted."""


class SessionAction(_Event):
    """A request to the host to perform a session-scoped action (the host owns its effect).

    `trigger` and `position` say which declaration it is (its index in that trigger's list); for on_enter,
    (task_id, step_id, entry_seq) is the entry it belongs to, `entry_seq` None when the step allocates no
    step-entry record (and for other triggers). `admission_seq` is the task's admission counter: it names the
    entry on every step, record or not (on_exit: the entry being left), so a host can deduplicate an entry's
    requests on it.
    """

    type: Literal["session_action"] = "session_action"
    """The event name."""
    task_id: str
    """The task."""
    session_id: str | None
    """The task's session (None when it has none)."""
    step_id: str
    """The step declaring the action."""
    action: str
    """The action type (`reset_agent_context`, `set_session_mode`, `auto_start_agent`, ...)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The action's declared config."""
    entry_path: EntryPath | None = None
    """How the step was entered (on_enter only)."""
    trigger: str
    """The trigger the action is declared under."""
    position: int
    """Its index in that trigger's list."""
    entry_seq: int | None = None
    """The entry it belongs to (on_enter with a step-entry record), else None."""
    admission_seq: int = 0
    """The task's admission counter (+1 at every step entry, durable): the entry dispatched (on_enter) or
    left (on_exit) on every step, record or not; 0 while the task sits where it was created."""


class HostCallUnanswered(_Event):
    """A call to a host connection of `onceflow serve` (its host role) reached no answer: no host with the
    capability took it within `--host-wait` seconds (`host_unavailable`: the call reached no executor), its
    host did not answer by the deadline (`host_timeout`), or the runtime stopped first (`cancelled`). The
    dispatch went on as after a failed host call; `list_host_calls` and the task's history keep the call."""

    type: Literal["host_call_unanswered"] = "host_call_unanswered"
    """The event name."""
    call_id: str
    """The call (deterministic: protocol/host_calls.py)."""
    kind: Literal["session_action", "code_review", "preflight", "deliver", "acknowledge"]
    """What it asked."""
    task_id: str | None
    """The task it was for (None for coordinator calls)."""
    status: Literal["host_unavailable", "host_timeout", "cancelled"]
    """Why it has no answer."""
    attempts: int
    """How many times it was offered to a host."""
    host_id: str | None
    """The host that held it last (None: none took it)."""
    message: str
    """What happened, for a human."""


class Diagnostic(_Event):
    """A log-worthy condition (a failed host call, a vote not counted, ...), with its identifying fields."""

    type: Literal["diagnostic"] = "diagnostic"
    """The event name."""
    level: Literal["debug", "info", "warning", "error"]
    """Its severity."""
    code: str
    """A stable name for the condition (`decision_not_counted`, `deferred_commit_failed`, ...)."""
    fields: dict[str, Any] = Field(default_factory=dict)
    """Its identifying fields (task_id, step_id, cause, ...) as discrete keys."""


Event = Annotated[
    TaskCreated
    | Transition
    | StepEntered
    | TaskQueued
    | GuardEvaluated
    | ActionOutcome
    | RunQueued
    | RunSuppressed
    | RunCoalesced
    | RunRateLimited
    | RunClaimHeld
    | RunRequeued
    | FlowChanged
    | RunClaimed
    | RunFinished
    | RunRetryScheduled
    | RunFailed
    | RunCancelled
    | RunLeaseExpired
    | DecisionRecorded
    | DecisionsCleared
    | SessionAction
    | HostCallUnanswered
    | Diagnostic,
    Field(discriminator="type"),
]


class ErrorInfo(BaseModel):
    """Why a command was refused. `field` names the offending field (dotted) when one is to blame.

    `retryable` is True when nothing of the command was committed and sending it again unchanged may succeed
    once the condition clears: `busy`, and the storage faults `storage_busy`, `storage_full`, `storage_io`,
    `storage_out_of_memory`, `storage_aborted`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=describe_fields)
    code: str
    """Stable, machine-readable: `invalid_message`, `not_found`, `storage_busy`, ... (see Error codes)."""
    message: str
    """What went wrong, for people."""
    field: str | None = None
    """The offending field as a dotted path (`children.0.state`), or None when no one field is to blame."""
    retryable: bool = False
    """True when nothing was committed and sending the same command again may succeed later."""


class Reply(BaseModel):
    """The answer to one command: `ok`, a JSON `result`, or an `error`; `events` it caused, in order.

    `result` is plain JSON whose shape depends on the command (`protocol/results.py`: `RESULTS` maps each
    command type to its result model; `result_of(reply)` validates it into that model).
    """

    model_config = ConfigDict(extra="forbid", json_schema_extra=describe_fields)
    type: Literal["reply"] = "reply"
    """Always `reply`."""
    command: str
    """The command's `type` as sent, known or not, also when it is refused; `unknown` when the message is
    not a JSON object or its `type` is not a string of 1 to 256 printable characters."""
    ok: bool
    """Whether the command was applied; False means `error` says why."""
    result: Any = None
    """What the command returned when `ok`; its shape is the command's result model (`results` in
    `onceflow schema`, `protocol/results.py`). None when not `ok`."""
    error: ErrorInfo | None = None
    """Why the command was refused; None when `ok`."""
    events: list[Event] = Field(default_factory=list)
    """The events the command caused, in the order they happened (also when it failed part-way)."""

    def raise_for_error(self) -> Reply:
        """This reply when `ok`, for chaining (`(await rt.send(c)).raise_for_error().result`); otherwise
        raise its error.

        Raises:
            RefusedError: the command was refused; its `code`, `field` and `retryable` are `error`'s, its
                `command` the command's type.
        """
        if self.ok:
            return self
        error = self.error or ErrorInfo(code="internal", message="refused without an error")
        raise RefusedError(
            self.command, error.code, error.message, field=error.field, retryable=error.retryable
        )
