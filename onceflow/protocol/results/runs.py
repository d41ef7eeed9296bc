"""What the run commands return: a run's row (and a claimed one's lease), what renewing, finishing,
cancelling, requeueing or retrying one did, the pages of runs and of review runs. Pure: no thread.

Each is a result typed dict (`result_base.py`); `results.py` maps each command type to its result.
"""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import TypedDict

from onceflow.protocol.results.base import as_result

RunStatus = Literal["queued", "claimed", "finished", "failed", "cancelled"]


@as_result
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


@as_result
class ClaimedRun(RunInfo):
    """`claim_run`: the run as claimed (status `claimed`, `lease_expires_at` set), with the claim its holder
    fences every later call with."""

    claim_token: str
    """The fencing token `renew_run` and `finish_run` take; a later claim mints another."""


@as_result
class RunRenewed(TypedDict):
    """`renew_run`: the lease extended."""

    run_id: int
    """The run."""
    lease_expires_at: str
    """When the lease now ends (RFC 3339 UTC)."""
    superseded: bool
    """True when its task has left the step entry that queued it: the agent may stop."""


@as_result
class RunCancelledResult(TypedDict):
    """`cancel_run`: the run is cancelled."""

    run_id: int
    """The run."""
    cancelled: bool
    """False when it was already cancelled (a no-op)."""


@as_result
class RunRequeued(TypedDict):
    """`requeue_run`: the claim handed back; the run is queued again in its place in line."""

    run_id: int
    """The run."""
    status: RunStatus
    """queued."""


@as_result
class RunRetried(TypedDict):
    """`retry_run`: the fresh run queued for a failed or cancelled one."""

    run_id: int
    """The new run (`retry_of` names the old one)."""
    retry_of: int
    """The run retried."""


@as_result
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


@as_result
class RunPage(TypedDict):
    """`list_runs`: one page of runs in run-id order."""

    runs: list[RunInfo]
    """The page."""
    next_after_run_id: int | None
    """Pass it as `after_run_id` for the next page; None on the last page."""


@as_result
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


@as_result
class ReviewRunPage(TypedDict):
    """`list_review_runs`: one page of review runs in review-run-id order."""

    review_runs: list[ReviewRunInfo]
    """The page."""
    next_after_review_run_id: int | None
    """Pass it as `after_review_run_id` for the next page; None on the last page."""
