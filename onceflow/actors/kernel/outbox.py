"""Where events go: the reply of the command that caused them, the window of recent events, and every
subscriber's stream. Trio thread.

Each command gets its own Outbox; `emit` appends to it and publishes the event at once.
Diagnostics are also written to the structured log with their fields as discrete keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, Protocol, cast, get_args

import trio

from onceflow.actors.kernel.event_window import DEFAULT_EVENT_WINDOW, SEQ_BLOCK, EventWindow
from onceflow.observability import metrics
from onceflow.observability.logs import get_logger
from onceflow.protocol import trusted
from onceflow.protocol.events import Diagnostic, ErrorInfo, Event, Reply
from onceflow.protocol.trusted import COMPACT, held

log = get_logger("onceflow")

_Level = Literal["debug", "info", "warning", "error"]
_LEVELS = frozenset(get_args(_Level))


class Watcher(Protocol):
    """What the hub tells of every published event of a type in `watches`, before any subscriber."""

    @property
    def watches(self) -> frozenset[str]: ...

    def on_publish(self, event: Event) -> None: ...


class EventHub(EventWindow):
    """Publishes every event: to the watchers, into the window of recent events it is (the event's seq,
    readers resuming from one: actors/kernel/event_window.py), and to each subscriber's stream (an
    unbounded channel; a closed one is dropped). `size`, `era`, `earlier`, `block`: `EventWindow`'s."""

    def __init__(
        self,
        *watchers: Watcher,
        size: int = DEFAULT_EVENT_WINDOW,
        era: int = 0,
        earlier: bool = False,
        block: int = SEQ_BLOCK,
    ) -> None:
        super().__init__(size, era=era, earlier=earlier, block=block)
        self._subscribers: list[trio.MemorySendChannel[Event]] = []
        self._retaining = False  # `serving`: the window is an audience
        # the watchers by event type (waiting claims, the retention trigger): an event of a type nobody
        # watches costs one dict lookup
        hooks: dict[str, list[Callable[[Event], None]]] = {}
        for watcher in watchers:
            for type_ in watcher.watches:
                hooks.setdefault(type_, []).append(watcher.on_publish)
        self._hooks = {type_: tuple(found) for type_, found in hooks.items()}

    def subscribe(self) -> trio.MemoryReceiveChannel[Event]:
        send, receive = trio.open_memory_channel[Event](math.inf)
        self._subscribers.append(send)
        return receive

    def publish(self, event: Event) -> None:
        for hook in self._hooks.get(event.type, ()):
            hook(event)
        # `EventWindow.append`, inlined: the call would cost more than the append itself (per event, on
        # the hot path)
        n = self.count = self.count + 1
        self._ring[n % self.size] = held(event)
        if n >= self._check_at:
            self._appended(n)
        if not self._subscribers:
            return
        for send in list(self._subscribers):
            try:
                send.send_nowait(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.remove(send)

    def publish_all(self, events: list[Event]) -> None:
        """`publish` each of `events` in order, in one call (an entry's events: the calls cost more than
        the work)."""
        hooks, ring, size = self._hooks, self._ring, self.size
        n = self.count
        for event in events:
            found = hooks.get(event.type)
            if found is not None:
                for hook in found:
                    hook(event)
            n += 1
            fields_set = event.__pydantic_fields_set__  # `trusted.held`, inlined
            ring[n % size] = event.__dict__ if fields_set is COMPACT.get(type(event)) else held(event)
            self.count = n  # each one as it goes: a hook may read it
            if n >= self._check_at:
                self._appended(n)
        if not self._subscribers:
            return
        for send in list(self._subscribers):
            try:
                for event in events:
                    send.send_nowait(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.remove(send)

    def serving(self) -> None:
        """The runtime serves from now on: a reader may resume over any event published, so every event
        has an audience (`has_subscribers`). Before (the start-up recovery scan) only subscribers count."""
        self._retaining = True

    def has_subscribers(self) -> bool:
        """Whether an event published now could be received: the runtime serves, or a stream is open."""
        return self._retaining or bool(self._subscribers)

    def close(self) -> None:
        for send in self._subscribers:
            send.close()
        self._subscribers.clear()
        super().close()


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
        if event.type in metrics.COUNTED_EVENTS:
            metrics.count_event(event)

    def emit_all(self, events: list[Event]) -> None:
        """`emit` each of `events` in order (`EventHub.publish_all`); `events` is not kept."""
        self.events += events
        self._hub.publish_all(events)
        counted = metrics.COUNTED_EVENTS
        for event in events:
            if event.type in counted:
                metrics.count_event(event)

    def note(self, event: Event) -> None:
        """Put `event` in this command's reply alone: not published, not counted (a reply's own detail,
        such as why a claim handed out nothing)."""
        self.events.append(event)

    def diagnostic(self, level: str, code: str, **fields: Any) -> None:
        """Log `code` at `level` with discrete fields, and emit it as a `diagnostic` event.

        Raises `pydantic.ValidationError` (field `level`) for a level that is not debug, info, warning or
        error, before anything is logged or emitted.
        """
        if level not in _LEVELS:
            Diagnostic(level=level, code=code, fields=fields)  # type: ignore[arg-type]  # raises, naming it
        getattr(log, level)(code, **fields)
        # `fields` is this call's own dict (no one else holds it), so the event may keep it uncopied
        self.emit(trusted.diagnostic(level=cast(_Level, level), code=code, fields=fields))

    def logged(
        self, level: Literal["info", "warning", "error"], code: str, fields: dict[str, Any]
    ) -> Diagnostic:
        """Log `code` at `level` with `fields` as discrete keys, and return the `diagnostic` event saying
        the same for the caller to emit (`emit_all`): the runtime's own level and fields, unvalidated;
        `fields` is kept, not copied (pass a dict nobody changes afterwards)."""
        getattr(log, level)(code, **fields)
        return trusted.diagnostic(level=level, code=code, fields=fields)

    def reply(self, command: str, *, result: Any = None, error: ErrorInfo | None = None) -> Reply:
        """The `Reply` to `command` carrying these events: `ok` with `result` when `error` is None, else not
        `ok` with `error`. Built without re-validating the events, each already a model the runtime built
        (built once, never re-validated when put in a `Reply`); it equals and serializes as
        `Reply(command=..., ok=..., result=... | error=..., events=...)` (tests/protocol/test_trusted.py)."""
        # a copy, as validation made: an event emitted later does not reach this reply
        return trusted.reply(command, list(self.events), result=result, error=error)

    def has_audience(self) -> bool:
        """Whether an event emitted now could be received: a reply will carry it, or the hub has an audience
        (the runtime serves, so a reader may resume over it; or a subscriber listens). The start-up recovery
        scan runs before `open_runtime` yields, so it has neither and may log and count instead of building
        events nobody receives (a resume from before the start is told of a gap anyway)."""
        return self._reply or self._hub.has_subscribers()

    def log(self, level: str, code: str, **fields: Any) -> None:
        """Log a diagnostic without emitting it: for a publisher with no audience (`has_audience`)."""
        getattr(log, level)(code, **fields)
