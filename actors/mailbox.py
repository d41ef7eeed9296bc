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


@attrs.frozen
class Envelope(Generic[M]):
    message: M
    reply: trio.MemorySendChannel[outcome.Outcome[Any]]


class Mailbox(Generic[M]):
    """A FIFO inbox. Closing it lets the owning actor drain what is queued and stop (clean shutdown)."""

    def __init__(self) -> None:
        send, receive = trio.open_memory_channel[Envelope[M]](math.inf)
        self._send = send
        self.inbox: trio.MemoryReceiveChannel[Envelope[M]] = receive

    async def ask(self, message: M) -> Any:
        """Deliver `message` and return the actor's reply value, re-raising its exception.

        Raises:
            trio.ClosedResourceError: the mailbox was closed (the runtime is shutting down).
        """
        reply_send, reply_receive = trio.open_memory_channel[outcome.Outcome[Any]](1)
        self._send.send_nowait(Envelope(message, reply_send))
        with reply_receive:
            result = await reply_receive.receive()
        return result.unwrap()

    def close(self) -> None:
        self._send.close()


def reply_to(envelope: Envelope[Any], result: outcome.Outcome[Any]) -> None:
    """Answer an envelope; an asker that stopped waiting (cancelled) is not an error."""
    try:
        envelope.reply.send_nowait(result)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        envelope.reply.close()
