"""Shared by the outcome tests: valid envelopes, waits bounded in real time, diagnostic waits.

The coordinator (`onceflow.testing.RecordingCoordinator`) is the host side (the spec's activities), so
faking it is fine;
the store is always a real SQLite file.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
import trio.testing
from helpers import ENVELOPE_SHA, gascity_envelope, ok

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Diagnostic, Event
from onceflow.testing import RecordingCoordinator

SHA = ENVELOPE_SHA
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
    """A valid envelope as JSON data (tests/helpers.py `gascity_envelope`)."""
    return gascity_envelope(**overrides)


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


async def until(coordinator: RecordingCoordinator, predicate: Callable[[], bool]) -> None:
    """`coordinator.until(predicate)`, failing after REAL_SECONDS of wall-clock time."""
    await within_real_time(lambda: coordinator.until(predicate))


async def diagnostic(events: trio.MemoryReceiveChannel[Event], code: str) -> Diagnostic:
    """The next `diagnostic` event with `code` on a subscription (others are skipped)."""

    async def wait() -> Diagnostic:
        async for event in events:
            if isinstance(event, Diagnostic) and event.code == code:
                return event
        raise AssertionError(f"the runtime closed before a {code} diagnostic")

    return await within_real_time(wait)
