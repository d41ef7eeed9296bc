"""What the host-role commands of `onceflow serve` return, and the records of the calls made to hosts.
Pure: no thread.

Each is a result typed dict (`result_base.py`); `results.py` maps each command type to its result.
"""

from __future__ import annotations

from typing_extensions import TypedDict

from onceflow.protocol.host_calls import CallKind, CallStatus, Capability
from onceflow.protocol.results.base import as_result


@as_result
class HostRegistered(TypedDict):
    """`register_host`'s result."""

    host_id: str
    """This connection's host id (`host-N`), named by the calls' records and by a refused move."""
    capabilities: list[Capability]
    """What it was registered for."""


@as_result
class HostReplyTaken(TypedDict):
    """`host_reply`'s result: the answer was taken."""

    call_id: str
    """The call answered."""
    status: CallStatus
    """`answered` or `refused`."""


@as_result
class HostCallError(TypedDict):
    """Why a call did not succeed."""

    code: str
    """`host_unavailable`, `host_timeout`, `cancelled`, or the host's own code (a refusal)."""
    message: str
    """What happened."""
    retryable: bool
    """Whether the same call may succeed later."""


@as_result
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


@as_result
class HostCallPage(TypedDict):
    """`list_host_calls`: one page of the calls made to host connections (`onceflow serve`'s host role)."""

    calls: list[HostCallInfo]
    """The page: recorded calls in record order, then (on the last page) those still pending."""
    next_after_id: int | None
    """Pass it as `after_id` for the next page; None on the last page."""
