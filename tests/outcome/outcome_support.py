"""Shared by the outcome tests: valid envelopes, a scriptable fake coordinator, diagnostic waits.

The fake coordinator is the host side (coordinator-outcome-delivery.md's activities), so faking it is fine;
the store is always a real SQLite file.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import trio
import trio.testing
from helpers import ok

from onceflow.actors.coordinator import AcknowledgeRequest, DeliveryRequest
from onceflow.actors.supervisor import Runtime
from onceflow.protocol.events import Diagnostic, Event
from onceflow.protocol.outcome import OutcomeDelivery, derive_outcome_id

SHA = "0123456789abcdef" * 4
REAL_SECONDS = 20.0

T = TypeVar("T")


async def within_real_time(wait: Callable[[], Awaitable[T]]) -> T:
    """`await wait()`, failing after REAL_SECONDS of wall-clock time instead of hanging the suite.

    A MockClock deadline would not do: the clock autojumps to the nearest deadline whenever every task is
    blocked, including on a store transaction, so a virtual-time limit could fire while the runtime works.
    The watchdog is a thread the wait never hops through, so the waiter wakes exactly as it would without.
    """
    done = threading.Event()

    async def watchdog() -> None:
        if not await trio.to_thread.run_sync(done.wait, REAL_SECONDS, abandon_on_cancel=True):
            raise AssertionError(f"still waiting after {REAL_SECONDS} s of real time")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watchdog)
        result = await wait()
        done.set()
        nursery.cancel_scope.cancel()
    return result


def envelope(**overrides: Any) -> dict[str, Any]:
    """A valid envelope as JSON data, keys in Go's order; `outcome_id` is derived after the overrides unless
    one is given."""
    data: dict[str, Any] = {
        "contract_version": 1,
        "outcome_id": None,
        "producer": "direct-worker",
        "store_ref": "city:gascity",
        "work_id": "gc-1234",
        "source_root_id": "gc-1000",
        "step_key": "implement",
        "summary": "Implemented the parser.",
        "impact": "Commands are parsed strictly.",
        "state": "terminal",
        "evidence": [{"kind": "commit", "uri": "git:repo@abc123", "sha256": SHA}],
        "fence": {"producer_id": "worker-7", "generation": 3, "token": "tok-9"},
        "occurred_at": "2023-11-14T22:13:20.5Z",
    }
    data.update(overrides)
    if data["outcome_id"] is None:
        data["outcome_id"] = derive_outcome_id(
            producer=data["producer"],
            store_ref=data["store_ref"],
            work_id=data["work_id"],
            state=data["state"],
            fence=data["fence"],
        )
    return data


def ack(env: dict[str, Any], fence: str, **overrides: Any) -> dict[str, Any]:
    """A coordinator_ack message for `env` under `fence`, acknowledged by `mayor`."""
    message = {
        "type": "coordinator_ack",
        "store_ref": env["store_ref"],
        "outcome_id": env["outcome_id"],
        "work_id": env["work_id"],
        "coordinator_fence": fence,
        "acknowledged_by": "mayor",
    }
    return {**message, **overrides}


def wire_ack(message: dict[str, Any]) -> dict[str, Any]:
    """An ack command's fields without its `type` tag: the acknowledgement the host is asked to commit."""
    return {key: value for key, value in message.items() if key != "type"}


async def ready(rt: Runtime, env: dict[str, Any]) -> dict[str, Any]:
    return dict((await ok(rt, json.dumps({"type": "outcome_ready", "envelope": env}))).result)


async def state(rt: Runtime, outcome_id: str) -> dict[str, Any]:
    return dict((await ok(rt, {"type": "get_outcome", "outcome_id": outcome_id})).result)


async def acknowledged(rt: Runtime, outcome_id: str) -> dict[str, Any]:
    """The outcome's state once it is acknowledged, for when no event subscription could see it happen
    (e.g. an outcome resumed while `open_runtime` starts). Polls between moments when every task is blocked;
    no timer, so it also works with a clock that never moves."""

    async def wait() -> dict[str, Any]:
        while (got := await state(rt, outcome_id))["phase"] != "acknowledged":
            await trio.testing.wait_all_tasks_blocked()
        return got

    return await within_real_time(wait)


@attrs.define
class FakeCoordinator:
    """A scriptable coordinator. Every call is recorded with `trio.current_time()`.

    Receipts are Gas City's `{delivery_ref, coordinator_fence}` with refs `bead:hq-mail-<n>`, and the
    coordinator is idempotent per delivery cycle, as a Gas City delivery adapter is: a cycle id it has
    received before gets the receipt it got then (`received`), even if that reply never reached the caller.
    `fence` is returned in new receipts (change it to model a coordinator restart); `down` makes every
    delivery raise; `failing_deliveries` / `failing_acks` make that many next attempts raise;
    `hanging_deliveries` / `hanging_acks` make that many next attempts wait forever; `receipt` overrides
    fields of every receipt; `during_delivery` is awaited inside every delivery attempt, after the receipt
    is recorded and before it is returned; `receipt_model` returns the receipt as an unvalidated
    `OutcomeDelivery` instead of a mapping.
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
        """Wait (no virtual-time timer) until `predicate()` holds after some call."""

        async def wait() -> None:
            while not predicate():
                await self._changed.wait()

        await within_real_time(wait)

    def delivery_ids(self) -> list[tuple[str, int]]:
        return [(request.cycle_id, request.attempt) for _, request in self.deliveries]

    def ack_ids(self) -> list[tuple[str, int]]:
        return [(request.cycle_id, request.attempt) for _, request in self.acks]


async def diagnostic(events: trio.MemoryReceiveChannel[Event], code: str) -> Diagnostic:
    """The next `diagnostic` event with `code` on a subscription (others are skipped)."""

    async def wait() -> Diagnostic:
        async for event in events:
            if isinstance(event, Diagnostic) and event.code == code:
                return event
        raise AssertionError(f"the runtime closed before a {code} diagnostic")

    return await within_real_time(wait)
