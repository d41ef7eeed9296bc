"""Test doubles for hosts that embed onceflow, and for onceflow's own tests: a recording host, a settable
wall clock (and one that follows Trio's clock) and a scriptable coordinator. Trio side: every call is made
on the runtime's Trio thread.

    from onceflow.testing import FakeClock, RecordingCoordinator, RecordingHost

    clock, host, coordinator = FakeClock(), RecordingHost(), RecordingCoordinator()
    async with onceflow.open_runtime(db, host=host, clock=clock, coordinator=coordinator) as rt:
        ...
        assert [r.action for r in host.session_actions] == ["reset_agent_context", "auto_start_agent"]
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from onceflow.protocol.coordinator import AcknowledgeRequest, DeliveryRequest
from onceflow.protocol.host import BaseHost, SessionActionRequest
from onceflow.protocol.outcome import OutcomeDelivery

START = 1_700_000_000.0
"""Unix seconds a `FakeClock` starts at (2023-11-14T22:13:20Z)."""


@attrs.define
class FakeClock:
    """A settable wall clock for `open_runtime(clock=...)`, in Unix seconds; it stands still unless
    advanced. A runtime reads it once, at open, then follows Trio's monotonic clock (actors/kernel/clock.py):
    advancing it while a runtime runs is a wall-clock step, which changes nothing there; the next runtime
    opened starts at the new reading. To move a running runtime's time, move Trio's
    (`trio.testing.MockClock.jump`)."""

    now: float = START

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock `seconds` forward."""
        self.now += seconds


@attrs.frozen
class TrioWallClock:
    """A wall clock for `open_runtime(clock=...)` that follows Trio's clock: `start` plus
    `trio.current_time()`, in Unix seconds. A runtime opened on it, at any Trio time, keeps time as if it had
    run since `start`: under `trio.testing.MockClock` one restarted in the same `trio.run` goes on where the
    last one was."""

    start: float = START

    def __call__(self) -> float:
        return self.start + trio.current_time()


@attrs.define
class RecordingHost(BaseHost):
    """A host that performs nothing, accepts every transition and remembers every request, in order."""

    session_actions: list[SessionActionRequest] = attrs.field(factory=list)
    code_reviews: list[tuple[str, str, int, int, str | None]] = attrs.field(factory=list)
    """(task_id, step_id, entry_seq, review_run_id, agent_profile_id) per `start_code_review`."""

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        self.session_actions.append(request)

    async def start_code_review(
        self, *, task_id: str, step_id: str, entry_seq: int, review_run_id: int, agent_profile_id: str | None
    ) -> None:
        self.code_reviews.append((task_id, step_id, entry_seq, review_run_id, agent_profile_id))


@attrs.define
class RecordingCoordinator:
    """A scriptable `Coordinator` that records every call with `trio.current_time()`.

    Receipts are Gas City's `{delivery_ref, coordinator_fence}` with refs `bead:hq-mail-<n>` (n counts
    deliveries), and it is idempotent per delivery cycle, as a Gas City delivery adapter is: a cycle id it has
    received before gets the receipt it got then (`received`), even if that reply never reached the caller.
    `fence` is returned in new receipts (change it to model a coordinator restart); `down` makes every
    delivery raise ConnectionError (an acknowledgement still commits); `failing_deliveries` / `failing_acks`
    make that many next attempts raise; `hanging_deliveries` / `hanging_acks` make that many next attempts
    wait until cancelled; `receipt` overrides fields of every receipt; `during_delivery` is awaited inside
    every successful delivery attempt, after the receipt is recorded and before it is returned;
    `receipt_model` returns the receipt as an unvalidated `OutcomeDelivery` instead of a mapping.
    """

    fence: str = "coord-1"
    down: bool = False
    failing_deliveries: int = 0
    failing_acks: int = 0
    hanging_deliveries: int = 0
    hanging_acks: int = 0
    receipt: dict[str, Any] = attrs.field(factory=dict)
    during_delivery: Callable[[DeliveryRequest], Awaitable[object]] | None = None
    receipt_model: bool = False
    received: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    deliveries: list[tuple[float, DeliveryRequest]] = attrs.field(factory=list)
    acks: list[tuple[float, AcknowledgeRequest]] = attrs.field(factory=list)
    _changed: trio.Event = attrs.field(factory=trio.Event)

    async def deliver(self, request: DeliveryRequest) -> OutcomeDelivery | dict[str, Any]:
        """Record the attempt, then fail, hang or return the cycle's receipt as scripted."""
        self._record(self.deliveries, request)
        if self.hanging_deliveries > 0:
            self.hanging_deliveries -= 1
            await trio.sleep_forever()
        if self.down or self.failing_deliveries > 0:
            self.failing_deliveries = max(0, self.failing_deliveries - 1)
            raise ConnectionError("coordinator unreachable")
        receipt = self.received.setdefault(
            request.cycle_id,
            {"delivery_ref": f"bead:hq-mail-{len(self.deliveries)}", "coordinator_fence": self.fence},
        )
        receipt = {**receipt, **self.receipt}
        if self.during_delivery is not None:
            await self.during_delivery(request)
        return OutcomeDelivery.model_construct(**receipt) if self.receipt_model else receipt

    async def acknowledge(self, request: AcknowledgeRequest) -> None:
        """Record the attempt, then fail or hang as scripted."""
        self._record(self.acks, request)
        if self.hanging_acks > 0:
            self.hanging_acks -= 1
            await trio.sleep_forever()
        if self.failing_acks > 0:
            self.failing_acks -= 1
            raise ConnectionError("canonical store unreachable")

    def _record(self, calls: list[Any], request: Any) -> None:
        calls.append((trio.current_time(), request))
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait until `predicate()` holds after some call (no timer: wrap it in one to bound the wait)."""
        while not predicate():
            await self._changed.wait()

    def delivery_ids(self) -> list[tuple[str, int]]:
        """(cycle_id, attempt) of every delivery attempt, in order."""
        return [(request.cycle_id, request.attempt) for _, request in self.deliveries]

    def ack_ids(self) -> list[tuple[str, int]]:
        """(cycle_id, attempt) of every acknowledgement attempt, in order."""
        return [(request.cycle_id, request.attempt) for _, request in self.acks]
