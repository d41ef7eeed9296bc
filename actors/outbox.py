"""Where events go: the reply of the command that caused them, and every subscriber's stream.

Each command gets its own Outbox; `emit` appends to it and fans the event out to subscribers at once.
Diagnostics are also written to the structured log with their fields as discrete keys.
"""

from __future__ import annotations

import math
from typing import Any

import trio

from onceflow import metrics
from onceflow.logs import get_logger
from onceflow.protocol.events import Diagnostic, Event

log = get_logger("onceflow")


class EventHub:
    """Broadcasts events to subscribers (unbounded channels; a closed subscriber is dropped)."""

    def __init__(self) -> None:
        self._subscribers: list[trio.MemorySendChannel[Event]] = []

    def subscribe(self) -> trio.MemoryReceiveChannel[Event]:
        send, receive = trio.open_memory_channel[Event](math.inf)
        self._subscribers.append(send)
        return receive

    def publish(self, event: Event) -> None:
        for send in list(self._subscribers):
            try:
                send.send_nowait(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.remove(send)

    def has_subscribers(self) -> bool:
        return bool(self._subscribers)

    def close(self) -> None:
        for send in self._subscribers:
            send.close()
        self._subscribers.clear()


class Outbox:
    """The events of one command, in emission order. `reply` False: no reply will carry them (the recovery
    scan's outboxes), so only the hub's subscribers can receive them."""

    def __init__(self, hub: EventHub, *, reply: bool = True) -> None:
        self._hub = hub
        self._reply = reply
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)
        self._hub.publish(event)
        metrics.count_event(event)

    def diagnostic(self, level: str, code: str, **fields: Any) -> None:
        """Log `code` at `level` with discrete fields, and emit it as a `diagnostic` event."""
        getattr(log, level)(code, **fields)
        self.emit(Diagnostic(level=level, code=code, fields=fields))  # type: ignore[arg-type]

    def has_audience(self) -> bool:
        """Whether an event emitted now could be received: a reply will carry it, or the hub has a subscriber.
        The recovery scan runs before `open_runtime` yields, so at startup it has neither and may log and
        count instead of building events nobody receives (issue 14)."""
        return self._reply or self._hub.has_subscribers()

    def log(self, level: str, code: str, **fields: Any) -> None:
        """Log a diagnostic without emitting it: for a publisher with no audience (`has_audience`)."""
        getattr(log, level)(code, **fields)
