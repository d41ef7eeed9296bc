"""The causation fields a command may carry (`caused_by_run_id`, `actor_kind`): every command model has
both. Pure: the wire, no thread.

A host that sends a command because of a run's work names that run in `caused_by_run_id`: each run the
command's actions queue then records it as its parent, one deeper in the same causation chain, so a loop of
runs causing runs is refused past the runtime's `max_causation_depth` (default 8), and an agent re-triggering
itself for one reason more than 3 times in a chain is refused too (docs/flow.md). A command a person sent
says `actor_kind: human`: the chain it roots is human-rooted (its runs are exempt from `runs_per_hour`), and
so are that chain's descendants. Neither field changes what else the command does.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from onceflow.protocol.field_docs import describe_fields
from onceflow.protocol.limits import INT64_MAX

CAUSE_FIELDS = ("caused_by_run_id", "actor_kind")
"""The fields every command has for its causation (docs/protocol.md lists them once)."""

ActorKind = Literal["human", "agent", "system"]


class Causation(BaseModel):
    """The causation fields every command accepts."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=describe_fields)

    caused_by_run_id: Annotated[int, Field(ge=1, le=INT64_MAX, strict=True)] | None = None
    """The run whose work made the sender send this command: runs it queues are that run's children. None: the
    runs it queues start chains of their own."""
    actor_kind: ActorKind | None = None
    """Who sent it: `human` roots a human chain (exempt from `runs_per_hour`); agent, system or None do
    not."""
