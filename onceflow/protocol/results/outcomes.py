"""What the outcome commands return (coordinator outcomes, Gas City's wire format): an outcome's
delivery state, a received outcome_ready, a queued acknowledgement. Pure: no thread.

Each is a result typed dict (`result_base.py`); `results.py` maps each command type to its result.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema
from typing_extensions import TypedDict

from onceflow.protocol.outcome import OutcomeEnvelope
from onceflow.protocol.results.base import as_result

OutcomePhase = Literal["pending", "needs-coordinator-ack", "acknowledged"]


class _AsEnvelope:
    """Validates JSON data as an `OutcomeEnvelope` (and documents it as one), keeping it JSON data."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(
            lambda envelope: envelope.model_dump(mode="json"), handler.generate_schema(OutcomeEnvelope)
        )


EnvelopeData = Annotated[dict[str, Any], _AsEnvelope]
"""An outcome envelope as JSON data, with `OutcomeEnvelope`'s shape and rules."""


@as_result
class OutcomeInfo(TypedDict):  # AC-CO-3
    """A coordinator outcome's durable state (`get_outcome`)."""

    outcome_id: str
    """The outcome."""
    envelope: EnvelopeData
    """The envelope as received (validated)."""
    behavior_version: int
    """The rules the record runs under."""
    phase: OutcomePhase
    """pending (not delivered yet), needs-coordinator-ack (delivered) or acknowledged."""
    delivery_attempts: int
    """Delivery cycles begun, all runtimes together."""
    duplicate_signals: int
    """Repeats of `outcome_ready` with the same envelope."""
    stale_acknowledgements: int
    """Acknowledgements discarded as not matching the current delivery (store, work or fence)."""
    delivery_ref: str | None
    """The last successful delivery's reference."""
    coordinator_fence: str | None
    """The last successful delivery's coordinator fence."""
    delivered_at: str | None
    """The first successful delivery (RFC 3339 UTC)."""
    acknowledged_at: str | None
    """When it was acknowledged (RFC 3339 UTC)."""
    last_delivery_error: str | None
    """local-delivery-failed, canonical-acknowledgement-failed or conflicting-outcome-ready-signal; None
    after a successful delivery."""
    acknowledged_by: str | None
    """Who acknowledged it."""
    cycle_in_flight: bool
    """True while a delivery cycle has begun and not ended."""


@as_result
class OutcomeReceived(TypedDict):  # AC-CO-11
    """`outcome_ready`: the outcome is recorded."""

    outcome_id: str
    """The outcome."""
    received: Literal["started", "duplicate"]
    """`started` the first time, `duplicate` for a repeat of the same envelope."""
    phase: OutcomePhase
    """Its phase now."""


@as_result
class AckQueued(TypedDict):  # AC-CO-16
    """`coordinator_ack`: the acknowledgement is in the outcome's inbox."""

    outcome_id: str
    """The outcome."""
    queued: bool
    """False when the outcome was already acknowledged by the same `acknowledged_by` (a no-op)."""
    phase: OutcomePhase
    """Its phase now."""
    acknowledged_by: str | None
    """Who acknowledged it, once committed."""
