"""An actor's mailbox: an unbounded Trio memory channel of envelopes with request/reply.

`ask` sends a message and waits for the actor's reply; the actor answers every envelope it takes with
`reply_to`, carrying either a value or the exception it raised (as an `outcome.Outcome`).
"""

from __future__ import annotations

import math
from typing import Any, Generic, TypeVar

import attrs
import outcome
import trio

M = TypeVar("M")


@attrs.define
class ReplySlot:
    """Where the actor puts its answer to one envelope; the asker waits on `answered`."""

    answered: trio.Event = attrs.field(factory=trio.Event)
    result: outcome.Outcome[Any] | None = None


@attrs.frozen
class Envelope(Generic[M]):
    message: M
    reply: ReplySlot


class Mailbox(Generic[M]):
    """A FIFO inbox. Closing it lets the owning actor drain what is queued and stop (clean shutdown)."""

    def __init__(self) -> None:
        send, receive = trio.open_memory_channel[Envelope[M]](math.inf)
        self._send = send
        self.inbox: trio.MemoryReceiveChannel[Envelope[M]] = receive

    async def ask(self, message: M) -> Any:
        """Deliver `message` and return the actor's reply value, re-raising its exception.

        A cancelled asker stops waiting; the actor still handles the message (and its answer is dropped).

        Raises:
            trio.ClosedResourceError: the mailbox was closed (the runtime is shutting down).
        """
        slot = ReplySlot()
        self._send.send_nowait(Envelope(message, slot))
        await slot.answered.wait()
        assert slot.result is not None
        return slot.result.unwrap()

    def close(self) -> None:
        self._send.close()

    @property
    def empty(self) -> bool:
        """No envelope is waiting (a cancelled receive never loses one, so this is exact after a timeout)."""
        return self.inbox.statistics().current_buffer_used == 0


def reply_to(envelope: Envelope[Any], result: outcome.Outcome[Any]) -> None:
    """Answer an envelope (at most once)."""
    if not envelope.reply.answered.is_set():
        envelope.reply.result = result
        envelope.reply.answered.set()
