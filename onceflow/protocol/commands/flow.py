"""The commands of flow control: the limits on claims and new runs, pausing and resuming a scope's runs,
and the queue's figures. Pure: the wire, no thread.

The rules every command shares (unknown fields refused, bounded fields) are `commands.py`'s.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from onceflow.protocol.commands.fields import (
    BaseCommand,
    Id,
    Text,
)

Count = Annotated[int, Field(ge=1, le=1_000_000, strict=True)]
"""A positive integer limit (sent as a JSON number; 0 is refused: pausing is how to stop)."""


class SetLimits(BaseCommand):
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


class _Scoped(BaseCommand):
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


class ListPauses(BaseCommand):
    """Every pause in force, oldest first."""

    type: Literal["list_pauses"] = "list_pauses"
    """The command name."""


class QueueStats(BaseCommand):
    """The queue per agent (queued, claimed, ceiling, oldest age, paused, rate-limited in the last hour),
    the limits and the pauses (what `onceflow queue` shows)."""

    type: Literal["queue_stats"] = "queue_stats"
    """The command name."""
