"""The host-facing coordinator: deliver an outcome, commit an acknowledgement, each under a bounded retry.

The spec's two Temporal activities become two async callables the host supplies (a `Coordinator`). One
logical call is a cycle with a stable id (`deliver/<outcome_id>/cycle-000001`, `ack/<outcome_id>/cycle-...`)
that every attempt of the cycle repeats, so the host can deduplicate the side effects of retries; attempts
follow the spec's RetryPolicy (AC-CO-4, AC-CO-10). Source: coordinator-outcome-delivery.md,
`executeOutcomeDelivery`, `executeOutcomeAcknowledgement`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

import attrs
import structlog
import trio

from onceflow.actors.durations import seconds
from onceflow.protocol.outcome import CoordinatorAck, OutcomeDelivery, OutcomeEnvelope

log = structlog.get_logger("onceflow.coordinator")

T = TypeVar("T")


def cycle_label(cycle: int) -> str:
    """`cycle-000001` for cycle 1: the spec's `cycle-%06d`."""
    return f"cycle-{cycle:06d}"


@attrs.frozen
class DeliveryRequest:
    """One attempt to deliver `envelope`. `cycle_id` is `deliver/<outcome_id>/<delivery_cycle>` and is the
    same for every attempt of the cycle; `attempt` counts from 1 within the cycle."""

    envelope: OutcomeEnvelope
    delivery_cycle: str
    cycle_id: str
    attempt: int


@attrs.frozen
class AcknowledgeRequest:
    """One attempt to commit `acknowledgement` in the canonical store. `cycle_id` is
    `ack/<outcome_id>/cycle-N`, N the delivery cycle being acknowledged; `attempt` counts from 1."""

    acknowledgement: CoordinatorAck
    cycle_id: str
    attempt: int


class Coordinator(Protocol):
    """What the host supplies to deliver outcomes. Both calls may raise; a raise is a failed attempt.

    `deliver` hands the outcome to the coordinator and returns its receipt (an `OutcomeDelivery` or the
    same fields as a mapping); a receipt for another outcome or work id, or with a malformed fence or ref,
    fails the whole cycle at once (AC-CO-5). `acknowledge` commits a matching acknowledgement durably.
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
    """The spec's activity options, in seconds: waits of 1, 2, 4, 8 between at most 5 attempts (capped at
    10), each attempt limited to 30 (StartToClose) and the whole cycle to 120 (ScheduleToClose).

    Raises ValueError naming the field for a duration that is not finite and positive, a backoff coefficient
    below 1 (or not finite), or fewer than 1 attempt (issue 11, section 5).
    """

    initial_interval: float = attrs.field(default=1.0, validator=_duration)
    backoff_coefficient: float = attrs.field(default=2.0, validator=_coefficient)
    maximum_interval: float = attrs.field(default=10.0, validator=_duration)
    maximum_attempts: int = attrs.field(default=5, validator=_attempts)
    attempt_timeout: float = attrs.field(default=30.0, validator=_duration)
    cycle_timeout: float = attrs.field(default=120.0, validator=_duration)

    async def run(self, call: Callable[[int], Awaitable[T]], *, cycle_id: str) -> T:
        """Return `call(attempt)` for the first attempt that does not raise.

        Raises:
            Exception: the last attempt's error when every attempt failed (trio.TooSlowError for a timeout).
            trio.TooSlowError: the cycle ran out of time.
        """
        attempt, wait = 1, self.initial_interval
        with trio.fail_after(self.cycle_timeout):
            while True:
                try:
                    with trio.fail_after(self.attempt_timeout):
                        return await call(attempt)
                except Exception as exc:
                    log.warning(
                        "coordinator_attempt_failed", cycle_id=cycle_id, attempt=attempt, error=repr(exc)
                    )
                    if attempt == self.maximum_attempts:
                        raise
                await trio.sleep(wait)
                attempt, wait = attempt + 1, min(wait * self.backoff_coefficient, self.maximum_interval)


RETRY = RetryPolicy()
