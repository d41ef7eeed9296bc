"""The coordinator contract: deliver an outcome, commit an acknowledgement, each under a bounded retry.

The spec's two Temporal activities become two async callables the host supplies (a `Coordinator`). One
logical call is a cycle with a stable id (`deliver/<outcome_id>/cycle-000001`, `ack/<outcome_id>/cycle-...`)
that every attempt of the cycle repeats, so the host can deduplicate the side effects of retries; attempts
follow a `RetryPolicy`, the spec's by default and a runtime setting (`open_runtime(retry_policy=...)`,
AC-CO-4, AC-CO-10, AC-CO-18). The objects handed over are Gas City's wire objects (gascity-wire-format.md):
`DeliveryRequest.message` is the `{envelope, delivery_cycle}` a Gas City delivery adapter takes, and
`AcknowledgeRequest.acknowledgement` the `{store_ref, outcome_id, work_id, coordinator_fence,
acknowledged_by}` its canonical store records. Source: coordinator-outcome-delivery.md,
`executeOutcomeDelivery`, `executeOutcomeAcknowledgement`. Pure contract: the runtime's outcome actors
(actors/runtime/outcome.py) make the calls and run the retries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from onceflow.protocol.durations import seconds
from onceflow.protocol.outcome import (
    OutcomeAcknowledgement,
    OutcomeDelivery,
    OutcomeDeliveryRequest,
    OutcomeEnvelope,
)


def cycle_label(cycle: int) -> str:
    """`cycle-000001` for cycle 1: the spec's `cycle-%06d`."""
    return f"cycle-{cycle:06d}"


@attrs.frozen
class DeliveryRequest:
    """One attempt to deliver an outcome. `message` is the wire request `{envelope, delivery_cycle}`;
    `cycle_id` is `deliver/<outcome_id>/<delivery_cycle>` and is the same for every attempt of the cycle,
    also when a cycle interrupted by a stop is retried at the next start (AC-CO-17); `attempt` counts from 1
    within one runtime's run of the cycle."""

    message: OutcomeDeliveryRequest
    cycle_id: str
    attempt: int

    @property
    def envelope(self) -> OutcomeEnvelope:
        """The outcome being delivered (`message.envelope`)."""
        return self.message.envelope

    @property
    def delivery_cycle(self) -> str:
        """The round's label, `cycle-000001` (`message.delivery_cycle`)."""
        return self.message.delivery_cycle


@attrs.frozen
class AcknowledgeRequest:
    """One attempt to commit `acknowledgement` in the canonical store. `cycle_id` is
    `ack/<outcome_id>/cycle-N`, N the delivery cycle being acknowledged; `attempt` counts from 1."""

    acknowledgement: OutcomeAcknowledgement
    cycle_id: str
    attempt: int


class Coordinator(Protocol):
    """What the host supplies to deliver outcomes. Both calls may raise; a raise is a failed attempt.

    `deliver` hands `request.message` to the coordinator and returns its receipt, `{delivery_ref,
    coordinator_fence}` (an `OutcomeDelivery` or the same fields as a mapping; `outcome_id` and `work_id`
    may be added); a receipt for another outcome or work id, or with a malformed fence or ref, fails the
    whole cycle at once (AC-CO-5). `acknowledge` commits `request.acknowledgement` durably in the canonical
    store.
    """

    async def deliver(self, request: DeliveryRequest) -> OutcomeDelivery | Mapping[str, Any]: ...

    async def acknowledge(self, request: AcknowledgeRequest) -> None: ...


def _duration(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    seconds(attribute.name, value)


def _coefficient(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value < math.inf:
        raise ValueError(f"{attribute.name} must be a finite number >= 1, got {value!r}")


def _attempts(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}")


@attrs.frozen
class RetryPolicy:
    """How one delivery or acknowledgement cycle retries, in seconds (AC-CO-4, AC-CO-10, AC-CO-18).

    The default is the spec's activity options: waits of 1, 2, 4, 8 between at most 5 attempts (each wait
    the previous one times `backoff_coefficient`, capped at `maximum_interval`), each attempt limited to
    `attempt_timeout` 30 (StartToClose) and the whole cycle to `cycle_timeout` 120 (ScheduleToClose).
    Pass another to `open_runtime(retry_policy=...)`.

    Raises:
        ValueError: a time is not finite and positive, the coefficient is below 1 or not finite, or
            `maximum_attempts` is not an int >= 1 (the message names the field).
    """

    initial_interval: float = attrs.field(default=1.0, validator=_duration)
    backoff_coefficient: float = attrs.field(default=2.0, validator=_coefficient)
    maximum_interval: float = attrs.field(default=10.0, validator=_duration)
    maximum_attempts: int = attrs.field(default=5, validator=_attempts)
    attempt_timeout: float = attrs.field(default=30.0, validator=_duration)
    cycle_timeout: float = attrs.field(default=120.0, validator=_duration)
