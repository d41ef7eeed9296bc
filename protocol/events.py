"""Events the runtime emits, and the reply to each command, as pydantic v2 models discriminated on `type`.

Events describe committed facts (a transition, a queued run) or requests to the host (session_action);
`diagnostic` carries a log-worthy condition with its identifying fields as discrete keys.
Source: the foundation issue, "Protocol".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

EntryPath = Literal["E1", "E2", "E3", "E4", "E5", "recovery"]


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskCreated(_Event):
    type: Literal["task_created"] = "task_created"
    task_id: str
    workflow_id: str
    step_id: str


class Transition(_Event):
    """The task's step changed (committed). `trigger` is what caused it (a trigger name or a command)."""

    type: Literal["transition"] = "transition"
    task_id: str
    workflow_id: str
    from_step: str
    to_step: str
    trigger: str


class StepEntered(_Event):
    """A step entry was admitted; `entry_seq` is None when on_enter declares no engine-owned action."""

    type: Literal["step_entered"] = "step_entered"
    task_id: str
    step_id: str
    entry_seq: int | None
    entry_path: EntryPath


class TaskQueued(_Event):
    """The task landed at a full step without being admitted (a queued placement: not an entry)."""

    type: Literal["task_queued"] = "task_queued"
    task_id: str
    step_id: str


class GuardEvaluated(_Event):
    type: Literal["guard_evaluated"] = "guard_evaluated"
    task_id: str
    step_id: str
    target_step: str
    role: str
    threshold: str
    satisfied: bool
    seats: int
    approvals: int
    reason: str


class ActionOutcome(_Event):
    """An action reached its dispatcher. outcome: done | skipped | failed | abandoned | already_done."""

    type: Literal["action_outcome"] = "action_outcome"
    task_id: str
    step_id: str
    trigger: str
    position: int
    kind: str
    outcome: str
    detail: str = ""


class RunQueued(_Event):
    type: Literal["run_queued"] = "run_queued"
    run_id: int
    task_id: str | None
    step_id: str | None
    agent_profile_id: str
    reason: str
    idempotency_key: str | None


class RunSuppressed(_Event):
    """An enqueue hit an idempotency key still honoured (its run unresolved, or resolved less than 24 h ago):
    a success that changed nothing. `existing_run_id` is the run the key produced or was merged into."""

    type: Literal["run_suppressed"] = "run_suppressed"
    existing_run_id: int
    task_id: str | None
    agent_profile_id: str
    reason: str
    idempotency_key: str


class RunCoalesced(_Event):
    """An enqueue merged into a queued run of the same task, agent and reason from the last 5 s."""

    type: Literal["run_coalesced"] = "run_coalesced"
    run_id: int
    task_id: str | None
    agent_profile_id: str
    reason: str
    coalesced_count: int


class DecisionRecorded(_Event):
    """A decision was stored. `role` is the one recorded: the command's, or resolved from the seat."""

    type: Literal["decision_recorded"] = "decision_recorded"
    decision_id: int
    task_id: str
    step_id: str
    decider_id: str
    decision: str
    role: str = ""


class DecisionsCleared(_Event):
    type: Literal["decisions_cleared"] = "decisions_cleared"
    task_id: str
    step_id: str
    deleted: int


class SessionAction(_Event):
    """A request to the host to perform a session-scoped action (the host owns its effect).

    `trigger` and `position` say which declaration it is (its index in that trigger's list); for on_enter,
    (task_id, step_id, entry_seq) is the entry it belongs to, `entry_seq` None when the step allocates no
    step-entry record (and for other triggers). `admission_seq` is the task's admission counter: it names
    the entry on every step, record or not (on_exit: the entry being left). Source: issue 16 item 3.
    """

    type: Literal["session_action"] = "session_action"
    task_id: str
    session_id: str | None
    step_id: str
    action: str
    config: dict[str, Any] = Field(default_factory=dict)
    entry_path: EntryPath | None = None
    trigger: str
    position: int
    entry_seq: int | None = None
    admission_seq: int = 0


class Diagnostic(_Event):
    type: Literal["diagnostic"] = "diagnostic"
    level: Literal["debug", "info", "warning", "error"]
    code: str
    fields: dict[str, Any] = Field(default_factory=dict)


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
    | DecisionRecorded
    | DecisionsCleared
    | SessionAction
    | Diagnostic,
    Field(discriminator="type"),
]


class ErrorInfo(BaseModel):
    """Why a command was refused. `field` names the offending field (dotted) when one is to blame.

    `retryable` is True when nothing of the command was committed and sending it again unchanged may succeed
    once the condition clears: `busy`, and the storage faults `storage_busy`, `storage_full`, `storage_io`,
    `storage_out_of_memory`, `storage_aborted` (issue 11, item 2).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    code: str
    message: str
    field: str | None = None
    retryable: bool = False


class Reply(BaseModel):
    """The answer to one command: `ok`, a JSON `result`, or an `error`; `events` it caused, in order."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["reply"] = "reply"
    command: str
    ok: bool
    result: Any = None
    error: ErrorInfo | None = None
    events: list[Event] = Field(default_factory=list)
