"""An actor's mailbox: an unbounded FIFO of envelopes with request/reply.

`ask` sends a message and waits for the actor's reply; the actor answers every envelope it takes with
`reply_to`, carrying either a value or the exception it raised (as an `outcome.Outcome`).

Built on a deque and Trio's low-level park/reschedule rather than a memory channel and an Event per reply:
a task actor gets a fresh mailbox for almost every message (it is evicted once idle), and a channel pair
plus an Event cost ~25 us per message, a tenth of an entry's Trio-side CPU. Like Trio's own primitives, the
waits are KI-protected: a KeyboardInterrupt between registering the waiter and parking would leave a wake
aimed at a task gone elsewhere. Trio thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

import outcome
import trio
from opentelemetry.context import Context
from trio.lowlevel import enable_ki_protection

M = TypeVar("M")


class ReplySlot:
    """Where the actor puts its answer to one envelope; the asker parks until it is there."""

    __slots__ = ("answered", "result", "waiter")

    def __init__(self) -> None:
        self.answered = False
        self.result: outcome.Outcome[Any] | None = None
        self.waiter: trio.lowlevel.Task | None = None  # the parked asker; None once it stopped waiting


class Envelope(Generic[M]):
    """One message, the slot its answer goes to, and the asker's trace context (None: not traced), which
    the actor makes current while it handles the message: the actor runs on a task of its own."""

    __slots__ = ("context", "message", "reply")

    def __init__(self, message: M, reply: ReplySlot, context: Context | None = None) -> None:
        self.message = message
        self.reply = reply
        self.context = context


class Mailbox(Generic[M]):
    """A FIFO inbox with one receiver. Closing it lets the owning actor drain what is queued and stop
    (clean shutdown)."""

    __slots__ = ("_closed", "_queue", "_receiver")

    def __init__(self) -> None:
        self._queue: deque[Envelope[M]] = deque()
        self._closed = False
        self._receiver: trio.lowlevel.Task | None = None  # the actor parked in `receive`

    @enable_ki_protection
    async def ask(self, message: M, context: Context | None = None) -> Any:
        """Deliver `message` (with the asker's trace `context`) and return the actor's reply value,
        re-raising its exception.

        A cancelled asker stops waiting; the actor still handles the message (and its answer is dropped).

        Raises:
            trio.ClosedResourceError: the mailbox was closed (the runtime is shutting down).
        """
        if self._closed:
            raise trio.ClosedResourceError("the mailbox is closed")
        slot = ReplySlot()
        self._queue.append(Envelope(message, slot, context))
        self._wake_receiver()
        slot.waiter = trio.lowlevel.current_task()

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            slot.waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        assert slot.result is not None
        return slot.result.unwrap()

    def receive_nowait(self) -> Envelope[M]:
        """The oldest queued envelope.

        Raises:
            trio.WouldBlock: none is queued.
            trio.EndOfChannel: none is queued and the mailbox is closed.
        """
        if self._queue:
            return self._queue.popleft()
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    @enable_ki_protection
    async def receive(self) -> Envelope[M]:
        """The oldest envelope, waiting for one. A cancelled wait takes none (nothing is lost).

        Raises:
            trio.EndOfChannel: the mailbox is closed and drained.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            envelope = self.receive_nowait()
        except trio.WouldBlock:
            pass
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()  # a checkpoint that cannot lose the envelope
            return envelope
        while True:
            self._receiver = trio.lowlevel.current_task()

            def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
                self._receiver = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
            try:
                return self.receive_nowait()
            except trio.WouldBlock:
                continue

    def __aiter__(self) -> AsyncIterator[Envelope[M]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Envelope[M]]:
        while True:
            try:
                yield await self.receive()
            except trio.EndOfChannel:
                return

    def close(self) -> None:
        self._closed = True
        self._wake_receiver()

    def _wake_receiver(self) -> None:
        if self._receiver is not None:
            receiver, self._receiver = self._receiver, None
            trio.lowlevel.reschedule(receiver)

    @property
    def empty(self) -> bool:
        """No envelope is waiting (a cancelled receive never loses one, so this is exact after a timeout)."""
        return not self._queue


def reply_to(envelope: Envelope[Any], result: outcome.Outcome[Any]) -> None:
    """Answer an envelope (at most once); an asker that stopped waiting is not woken."""
    slot = envelope.reply
    if slot.answered:
        return
    slot.answered, slot.result = True, result
    if slot.waiter is not None:
        waiter, slot.waiter = slot.waiter, None
        trio.lowlevel.reschedule(waiter)
