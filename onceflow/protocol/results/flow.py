"""What the flow-control commands return: a limit, a pause, the pauses in force and the queue's figures.
Pure: no thread.

Each is a result typed dict (`result_base.py`); `results.py` maps each command type to its result.
"""

from __future__ import annotations

from typing import Literal

from typing_extensions import TypedDict

from onceflow.protocol.results.base import as_result


@as_result
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


@as_result
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


@as_result
class PauseResult(TypedDict):
    """`pause`: the pause in force."""

    pause: PauseInfo
    """The pause (a scope paused already keeps its first pause)."""
    created: bool
    """False when the scope was paused already (a no-op)."""


@as_result
class ResumeResult(TypedDict):
    """`resume`: the pause lifted; its runs go out again in their order."""

    resumed: bool
    """False when the scope was not paused (a no-op)."""


@as_result
class PauseList(TypedDict):
    """`list_pauses`: every pause, oldest first."""

    pauses: list[PauseInfo]
    """The pauses."""


@as_result
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


@as_result
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
