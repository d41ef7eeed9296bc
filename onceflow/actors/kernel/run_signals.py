"""Wake-ups for claims waiting for work (`claim_run` with `wait_seconds`). Trio thread.

The event hub tells `RunSignals` of the events it watches (`EventHub(signals, ...)`); a `run_queued`,
`run_lease_expired` or `run_retry_scheduled` of an agent wakes every claim of that agent waiting now, and a
`run_claimed` wakes the lease sweep (a new lease may end before the one it sleeps for). A waiter takes the
agent's current `trio.Event` *before* it tries to claim, so a run committed after its attempt began wakes
it (no lost wake-up), and only waiters hold events: an agent nobody waits for costs nothing.

Flow control: a claim's end (`run_finished`, `run_failed`, `run_cancelled`, `run_requeued`) frees a slot
under the agent's ceiling, so it wakes the agent's waiters too; a `flow_changed` (limits, pause, resume)
wakes every waiter. A claim across agents (or for any agent) waits under `ANY`, which every wake-up sets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

from onceflow.protocol.events import Event

WAKING = frozenset(
    {
        "run_queued",
        "run_lease_expired",
        "run_retry_scheduled",
        "run_finished",
        "run_failed",
        "run_cancelled",
        "run_requeued",
    }
)
"""The events after which a waiting claim of the event's agent looks again (a retry's time may be
sooner than the one it waits for)."""

WATCHES = WAKING | {"run_claimed", "flow_changed"}

ANY = "\x00any"
"""The key a claim across agents (or for any agent) waits under: no agent profile id can be it."""


class RunSignals:
    """Per agent profile, the `trio.Event` its waiting claims sleep on; set (and replaced) on a wake-up."""

    watches = WATCHES
    """The event types the hub tells it of (`on_publish`)."""

    def __init__(self) -> None:
        self._events: dict[str, trio.Event] = {}
        self._waiters: dict[str, int] = {}
        self.leased = trio.Event()
        """Set when this runtime grants a lease (then replaced): the lease sweep looks at its end."""

    @contextlib.contextmanager
    def waiting(self, agent_profile_id: str) -> Iterator[None]:
        """Count a waiter of the agent while the block runs; the agent's event goes with its last waiter."""
        self._waiters[agent_profile_id] = self._waiters.get(agent_profile_id, 0) + 1
        try:
            yield
        finally:
            left = self._waiters.pop(agent_profile_id) - 1
            if left:
                self._waiters[agent_profile_id] = left
            else:
                self._events.pop(agent_profile_id, None)

    def current(self, agent_profile_id: str) -> trio.Event:
        """The event the agent's next wake-up sets (take it before looking for a run, inside `waiting`)."""
        event = self._events.get(agent_profile_id)
        if event is None:
            event = self._events[agent_profile_id] = trio.Event()
        return event

    def notify(self, agent_profile_id: str) -> None:
        """Wake every claim of the agent waiting now."""
        event = self._events.pop(agent_profile_id, None)
        if event is not None:
            event.set()
        event = self._events.pop(ANY, None)
        if event is not None:
            event.set()

    def notify_all(self) -> None:
        """Wake every waiting claim (flow control changed)."""
        events, self._events = self._events, {}
        for event in events.values():
            event.set()

    def on_publish(self, event: Event) -> None:
        """The hub's hook: wake the waiters of a `WAKING` event's agent; tell the lease sweep of a claim."""
        if event.type == "flow_changed":
            self.notify_all()
        elif event.type != "run_claimed":
            if self._events:
                self.notify(getattr(event, "agent_profile_id", ""))
        else:
            self.leased.set()
            self.leased = trio.Event()
