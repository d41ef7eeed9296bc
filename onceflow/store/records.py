"""Plain, immutable rows read from the store.

These are the shapes the engine reasons over. They are built inside the store's writer thread from
SQLite rows and handed to the Trio side; nothing here touches the database.
Timestamps are Unix seconds (float).
"""

from __future__ import annotations

from typing import Literal

import attrs

from onceflow.protocol.commands import Priority
from onceflow.protocol.events import EntryPath

DeciderType = Literal["agent", "user"]
DecisionValue = Literal["approved", "rejected", "changes_requested"]
ParticipantRole = Literal["reviewer", "approver", "watcher", "collaborator", "runner"]


@attrs.frozen
class Participant:
    """A participant row: a seat a role-holder may occupy at a step.

    `task_id` is None for a template-level row (it applies to every task of `workflow_id` at `step_id`);
    a per-task row names its task. `agent_profile_id` may be empty (such rows are never merged into a seat).
    Source: kandev-engine-notes.md, "Template format" (participants are rows, not YAML).
    """

    id: int
    workflow_id: str
    step_id: str
    task_id: str | None
    role: str
    agent_profile_id: str
    decision_required: bool
    position: int


@attrs.frozen
class Decision:
    """A recorded decision for (task_id, step_id).

    `participant_id` is set when the decider named its seat; otherwise agent deciders are mapped to seats by
    (role, decider_id). `created_at` is Unix seconds; `id` breaks ties so "oldest first" is total.
    """

    id: int
    task_id: str
    step_id: str
    participant_id: int | None
    role: str
    decider_type: DeciderType
    decider_id: str
    decision: DecisionValue
    comment: str
    created_at: float


@attrs.frozen
class TaskRecord:
    """A task row. `step_id` is its `workflow_step_id`; `wip_admitted` False means queued at the step;
    `admissions` counts its step entries (1 after the first), so (id, admissions) names the entry the task
    is in now, on every step, whether or not the step allocates a step-entry record. `workflow_version` is
    the version of its workflow it is pinned to (store/tasks/workflows.py): its steps, actions and quorum
    rules are that version's until it is migrated (store/tasks/task_migration.py)."""

    id: str
    workflow_id: str
    step_id: str
    title: str
    session_id: str | None
    primary_agent_id: str | None
    ceo_agent_id: str | None
    priority: Priority
    wip_admitted: bool
    queued_for_step_id: str | None
    created_at: float
    updated_at: float
    admissions: int = 0
    workflow_version: int = 1


RunStatus = Literal["queued", "claimed", "finished", "failed", "cancelled"]


@attrs.frozen
class RunRecord:
    """A row of the runs queue. `payload` is the decoded JSON object or None (SQL NULL); times are Unix
    seconds; `claim_token` is the current (or last) claim's fencing token. Flow control (store/runs/flow.py):
    `priority` 0..3, causation (`parent_run_id`, `causation_depth`, `chain_id`: the root run's id,
    `human_rooted`), `retry_of`, the decoded `result`, and `rate_limit`: the limit that refused its enqueue
    (the run is then cancelled `rate_limited`)."""

    id: int
    agent_profile_id: str
    task_id: str | None
    step_id: str | None
    reason: str
    payload: dict[str, object] | None
    idempotency_key: str | None
    exclude_from_coalescing: bool
    status: RunStatus
    coalesced_count: int
    requested_at: float
    trigger: str | None = None
    entry_seq: int | None = None
    admission_seq: int | None = None
    attempt: int = 0
    retries: int = 0
    claim_token: str | None = None
    lease_expires_at: float | None = None
    retry_at: float | None = None
    superseded: bool = False
    outcome_reason: str | None = None
    last_error: str | None = None
    finished_at: float | None = None
    priority: int = 2
    parent_run_id: int | None = None
    causation_depth: int = 0
    chain_id: int | None = None
    human_rooted: bool = False
    retry_of: int | None = None
    result: object = None
    rate_limit: str | None = None


@attrs.frozen
class StepEntry:
    """A durable step-entry record (on-enter-action-dispatch.md, Execution model). `workflow_version` is, in
    the recovery scan, the version its task is pinned to (what the entry is resumed under); 1 elsewhere."""

    task_id: str
    step_id: str
    entry_seq: int
    workflow_id: str
    declaration_digest: str
    entry_path: EntryPath
    terminal: bool
    workflow_version: int = 1


MarkerState = Literal["in_progress", "done", "skipped", "failed"]


@attrs.frozen
class Marker:
    """A per-action marker of a step entry; absent markers have no row."""

    position: int
    kind: str
    state: MarkerState
    epoch: str | None
    detail: str
