"""The commands about runs, the work handed out to agents: claim, renew, finish, cancel, requeue and retry
one, read and list them, and list the records of the review runs and host calls the runtime started.
Pure: the wire, no thread.

The rules every command shares (unknown fields refused, bounded fields) are `commands.py`'s.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from onceflow.protocol.commands.fields import (
    BaseCommand,
    Id,
    Int64,
    Limit,
    Name,
    Text,
)
from onceflow.protocol.host_calls import CallKind, CallStatus
from onceflow.protocol.limits import (
    MAX_LIST_ITEMS,
)
from onceflow.protocol.times import Instant

Seconds = Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)]
"""A duration in seconds, finite and positive, at most a day."""


class ClaimRun(BaseCommand):
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


class RenewRun(BaseCommand):
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


class FinishRun(BaseCommand):
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


class CancelRun(BaseCommand):
    """Cancel a queued or claimed run (a compare-and-set on its status, `run_cancelled`); a claimed one's
    holder then gets a `conflict` naming `claim_token` from `renew_run` and `finish_run`. Cancelling a
    finished or failed run is a `conflict` naming `run_id`; cancelling a cancelled one is a no-op."""

    type: Literal["cancel_run"] = "cancel_run"
    """The command name."""
    run_id: Int64
    """The run."""
    reason: Name = "cancelled_by_host"
    """Why (the `run_cancelled` event carries it)."""


class GetRun(BaseCommand):
    """One run as `list_runs` shows it (its stored `result` included); `not_found` naming `run_id` when there
    is none (or it was pruned)."""

    type: Literal["get_run"] = "get_run"
    """The command name."""
    run_id: Int64
    """The run."""


class RequeueRun(BaseCommand):
    """Hand a claimed run back to the queue (a compare-and-set on the current `claim_token`): queued again in
    its place in line (its attempt counted), for any claimer; a stale token is a `conflict` naming
    `claim_token`. `run_requeued` says so."""

    type: Literal["requeue_run"] = "requeue_run"
    """The command name."""
    run_id: Int64
    """The claimed run."""
    claim_token: Id
    """The token its claim returned."""


class RetryRun(BaseCommand):
    """Queue a fresh run for a failed or cancelled one (also one refused `rate_limited`: an operator's retry
    passes the limits): same agent, task, step, reason and payload, priority at most 1 (recovery), in the
    same causation chain, linked by `retry_of`. Any other status is a `conflict` naming `run_id`."""

    type: Literal["retry_run"] = "retry_run"
    """The command name."""
    run_id: Int64
    """The failed or cancelled run."""


class ListRuns(BaseCommand):
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


class ListReviewRuns(BaseCommand):
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


class ListHostCalls(BaseCommand):
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
