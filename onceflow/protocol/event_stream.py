"""What a subscriber with a resume point receives: each event with its `event_seq`, and a gap marker where
events it asked for are no longer held. Pure.

An `event_seq` is assigned to every event when the runtime publishes it. Seqs increase strictly, within a
runtime's life and across its restarts on the same database, but are not consecutive: they jump at every
start and every few million events (actors/kernel/event_window.py lays them out), so a client compares
them and never counts with them. Every seq is below 2**53, exact as a JavaScript number.

A subscriber asks for the events `after` the last seq it processed; the runtime replays those it still
holds (its last `event_window` events), then continues live. When some are gone (older than the window,
from before a restart, or `after` names no position of this runtime's stream) it first gets one
`EventGap`: the events between `after` and `next` may be missing, so the client reads the durable state
(`get_task`, `task_history`, `list_runs`, ...) and carries on from `next`.
"""

from __future__ import annotations

import attrs

from onceflow.protocol.errors import ProtocolError, shown
from onceflow.protocol.events import Event

MAX_EVENT_SEQ = 2**53 - 1
"""No event_seq is larger: each is an exact integer in JavaScript."""
MAX_AFTER = 2**63 - 1
"""`after` is an int64 (a client may hold any seq a stream could have shown, and then some)."""


@attrs.frozen
class SequencedEvent:
    """One event and its `seq` (the event_seq it was published with)."""

    seq: int
    event: Event


@attrs.frozen
class EventGap:
    """Events the subscriber asked for that the runtime no longer holds: some of those with a seq above
    `after` and below `next` may be missing; every event from `next` on follows, in order."""

    after: int
    next: int


def check_after(value: object) -> int:
    """`value` as a resume point: an integer in 0..2**63-1 (JSON `true` and `1.0` are not integers).

    Raises:
        ProtocolError: anything else, with field `after`.
    """
    if type(value) is not int or not 0 <= value <= MAX_AFTER:
        raise ProtocolError(
            f"after must be an integer from 0 to {MAX_AFTER} (the last event_seq processed), not"
            f" {shown(value)}",
            field="after",
        )
    return value
