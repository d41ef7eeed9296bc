"""The runtime's recent events, each with its event_seq, and readers that resume from a seq. Trio thread.

Every published event is appended to a ring of the last `size` events (`EventWindow.append`: a counter and a
slot store, nothing encoded; most events are kept as their field values, which the cyclic GC does not
traverse, and rebuilt as equal events when read: `protocol.trusted.held`). Its seq is not stored: it follows
from the event's ordinal (1 for the runtime's first event, then 2, ...) and the seq blocks the runtime holds.

Seq layout: `seq = era * SEQ_BLOCK + k`, k in 1..SEQ_BLOCK, where an era is a durable counter
(store/event_eras.py) the runtime bumps at every start and again whenever half of its current block is used
(actors/runtime/event_eras.py `renew_eras_forever`); the next block's era arrives long before the current one
runs out (2**23 events later), and the runtime moves to it at once. So seqs increase strictly, within a
start and across restarts on the same database (a later start's era is larger), and jump at each new
block. Eras stay below `MAX_ERA`, so every seq is below 2**53 (protocol/event_stream.py).

An `EventStream` reads the window from a position without ever holding the runtime back: the runtime
never waits on a reader, and a reader that falls more than `size` events behind finds a gap.
"""

from __future__ import annotations

import sys

import trio
from trio.lowlevel import enable_ki_protection

from onceflow.observability.logs import get_logger
from onceflow.protocol.event_stream import MAX_EVENT_SEQ, EventGap, SequencedEvent, check_after
from onceflow.protocol.events import Event
from onceflow.protocol.trusted import Held, held, restored

log = get_logger("onceflow")

SEQ_BLOCK = 1 << 24
"""Seqs per era; a new era is asked for once half of them are used."""
MAX_ERA = (MAX_EVENT_SEQ + 1) // SEQ_BLOCK - 1
"""The largest era whose seqs stay below 2**53 (about 5e8 starts and renewals)."""
DEFAULT_EVENT_WINDOW = 10_000
"""Events a runtime keeps for readers resuming from a seq (`open_runtime(event_window=...)`)."""
MAX_EVENT_WINDOW = 1_000_000
"""The largest window: its ring is allocated up front (8 bytes a slot) and holds its events alive."""


def event_window_size(value: object) -> int:
    """`value` as a window size: an integer in 1..MAX_EVENT_WINDOW. Raises ValueError naming
    `event_window` otherwise."""
    if type(value) is not int or not 1 <= value <= MAX_EVENT_WINDOW:
        raise ValueError(f"event_window must be an integer from 1 to {MAX_EVENT_WINDOW}, got {value!r}")
    return value


class EventWindow:
    """The last `size` events published, and the seq of each.

    `era` is this runtime's first era (0 without a database: seqs 1, 2, ...); `earlier` says whether any
    era was allocated before it on the database (a stream may have come before this one). `block` is
    `SEQ_BLOCK` but in tests.
    """

    def __init__(
        self, size: int = DEFAULT_EVENT_WINDOW, *, era: int = 0, earlier: bool = False, block: int = SEQ_BLOCK
    ) -> None:
        self.size = event_window_size(size)
        # each event as `trusted.held` keeps it: most as their field values, which the cyclic GC skips
        self._ring: list[Held | None] = [None] * self.size
        self.count = 0  # events appended: the newest one's ordinal
        self._block = block
        self._start = era * block  # below every seq of this stream
        self._earlier = earlier
        # (first ordinal, base) per block in use, oldest first: ordinal o >= first has seq
        # base + o - first + 1
        self._segments: list[tuple[int, int]] = [(1, self._start)]
        self._block_at = block // 2  # the ordinal at which the block needs looking after (`_block_used`)
        self._check_at = self._block_at  # the next ordinal `_appended` must see (block, or waiting reader)
        self.renewal = trio.Event()  # set when the next era is wanted; replaced by `adopt`
        self._news: trio.Event | None = None  # set at the next append, when a reader waits for one
        self.closed = False

    def append(self, event: Event) -> None:
        """Keep `event` as the newest (the oldest beyond `size` is dropped) and wake waiting readers.
        `EventHub.publish` inlines this body: keep the two equal."""
        n = self.count = self.count + 1
        self._ring[n % self.size] = held(event)
        if n >= self._check_at:
            self._appended(n)

    def _appended(self, n: int) -> None:
        """The rare part of an append: wake the waiting readers, look after the block. (One comparison on
        the hot path covers both: `changed` lowers `_check_at` while a reader waits.)"""
        news = self._news
        if news is not None:
            self._news = None
            news.set()
        if n >= self._block_at:
            self._block_used(n)
        self._check_at = self._block_at

    def _block_used(self, n: int) -> None:
        """Half the block is used: ask for the next era. All of it (no era came for 2**23 events): log it,
        and go on into the next era's seqs, which a later start may reuse."""
        if not self.renewal.is_set():
            first, _ = self._segments[-1]
            self.renewal.set()
            self._block_at = first + self._block  # the ordinal whose seq would leave the block
        else:
            log.error("event_seq_block_exhausted", seq=self.seq_of(n), block=self._block)
            self._block_at = sys.maxsize  # once

    def adopt(self, era: int) -> bool:
        """Number the next events in `era`'s block (a fresh era, larger than any this runtime used); False
        (logged at ERROR) when `era` is past `MAX_ERA`: the current block goes on."""
        if era > MAX_ERA:
            log.error("event_seq_space_exhausted", era=era, max_era=MAX_ERA)
            return False
        base = max(era * self._block, self.seq_of(self.count))  # never back: a block overflowed past it
        self._segments.append((self.count + 1, base))
        self._block_at = self.count + self._block // 2
        self._check_at = min(self._check_at, self._block_at)
        self.renewal = trio.Event()
        needed = self.count - self.size  # the newest dropped ordinal: its seq tells a reader of a gap
        while len(self._segments) > 1 and self._segments[1][0] <= needed:
            del self._segments[0]
        return True

    def close(self) -> None:
        """No more events: readers end once they have read what is held."""
        self.closed = True
        if self._news is not None:
            self._news.set()

    async def changed(self) -> None:
        """Wait for the next append (or close)."""
        if self._news is None:
            self._news = trio.Event()
            self._check_at = self.count + 1  # the next append wakes it
        await self._news.wait()

    def read(self, after: int, end: int) -> list[SequencedEvent]:
        """The events of ordinals after `after` up to `end`, with their seqs (all held: `oldest` - 1 <=
        `after`, `end` <= `count`)."""
        ring, size = self._ring, self.size
        taken = []
        for ordinal in range(after + 1, end + 1):
            kept = ring[ordinal % size]
            assert kept is not None
            taken.append(SequencedEvent(self.seq_of(ordinal), restored(kept)))
        return taken

    # Seqs and ordinals ----------------------------------------------------------------------------------

    @property
    def oldest(self) -> int:
        """The oldest ordinal held (count + 1 when none is)."""
        return max(1, self.count - self.size + 1)

    def seq_of(self, ordinal: int) -> int:
        """The seq of the event of `ordinal` (0: the stream's start, below all of its seqs; count + 1: the
        next event's, unless a new block comes first). Defined for ordinals from the oldest held minus 1."""
        if ordinal <= 0:
            return self._start
        for first, base in reversed(self._segments):
            if ordinal >= first:
                return base + ordinal - first + 1
        return self._segments[0][1]  # older than any block kept: below every seq held

    def _ordinal_at(self, seq: int) -> int:
        """The ordinal of the newest event whose seq is at most `seq` (0: none of this stream; a result
        below the oldest held minus 1 means only that events after `seq` were dropped)."""
        last = self.count
        for first, base in reversed(self._segments):
            if seq > base:
                return min(first + seq - base - 1, last)
            last = first - 1
        return last  # before every block kept: 0 when that is the stream's start

    def position(self, after: int | None) -> tuple[int, EventGap | None]:
        """Where a reader resuming after seq `after` starts (the ordinal it has read up to), and the gap it
        is told of first, if any; None: from now on.

        A gap when: events after `after` were dropped from the window; `after` is at or before this
        stream's start and another stream may have come before it on the database (a restart: nothing
        tells whether the client saw all of the previous one's); or `after` is beyond the newest seq
        (another stream's position: the reader starts from now). Its `next` is the first seq delivered.
        """
        if after is None:
            return self.count, None
        newest = self.seq_of(self.count)
        if after > newest:
            return self.count, EventGap(after, self.seq_of(self.count + 1))
        at = self._ordinal_at(after)
        oldest = self.oldest
        if at < oldest - 1 or (after <= self._start and self._earlier):
            start = max(at, oldest - 1)
            return start, EventGap(after, self.seq_of(start + 1))
        return at, None


class EventStream:
    """Events from a position in the window, with their seqs: `async for item in stream` yields a
    `SequencedEvent` per event, in seq order, each once; an `EventGap` first when events after `after`
    are no longer held, and again wherever the reader fell more than the window behind (it then goes on
    from the oldest event held). Ends when the runtime closes, after what was published before.

    Never holds the runtime back; holds nothing but its position (nothing to close). `after` None: from
    now on; else the last seq the reader processed (`check_after`).

    Raises ProtocolError (field `after`) for an `after` that is not an integer in 0..2**63-1.
    """

    def __init__(self, window: EventWindow, after: int | None = None) -> None:
        if after is not None:
            after = check_after(after)
        self._window = window
        self._read, self.gap = window.position(after)  # the ordinal read up to; the starting gap
        self._pending: EventGap | None = self.gap  # not yet yielded by `__anext__`

    @property
    def next_seq(self) -> int:
        """A lower bound of the next seq this stream delivers: no event from it on is missed."""
        return self._window.seq_of(self._read + 1)

    @property
    def caught_up(self) -> bool:
        """Whether every event published so far was taken."""
        return self._read >= self._window.count

    def take(self, limit: int) -> list[SequencedEvent] | EventGap:
        """Up to `limit` events (none when caught up), without waiting; an `EventGap` when the reader fell
        more than the window behind (it is then moved to the oldest event held)."""
        window = self._window
        oldest = window.oldest
        if self._read < oldest - 1:
            gap = EventGap(window.seq_of(self._read), window.seq_of(oldest))
            self._read = oldest - 1
            return gap
        end = min(window.count, self._read + limit)
        taken = window.read(self._read, end)
        self._read = end
        return taken

    @enable_ki_protection
    async def wait(self) -> bool:
        """Wait until there is something to take; False once the runtime closed and all was taken. Returns
        at once (no checkpoint) when there is."""
        window = self._window
        while self._read >= window.count:
            if window.closed:
                return False
            await window.changed()
        return True

    def batch(self, limit: int) -> list[SequencedEvent | EventGap]:
        """What is there now, without waiting: the starting gap if not yet yielded, then up to `limit`
        events (a gap instead where the reader fell behind)."""
        items: list[SequencedEvent | EventGap] = []
        if self._pending is not None:
            items.append(self._pending)
            self._pending = None
        taken = self.take(limit)
        if isinstance(taken, EventGap):
            items.append(taken)
            taken = self.take(limit)
        assert not isinstance(taken, EventGap)  # just moved to the oldest held
        items += taken
        return items

    @enable_ki_protection
    async def next_batch(self, limit: int) -> list[SequencedEvent | EventGap]:
        """`batch`, waiting until it has something; empty once the runtime closed and all was read."""
        if self._pending is None and not await self.wait():
            return []
        return self.batch(limit)

    @enable_ki_protection
    def __aiter__(self) -> EventStream:
        return self

    @enable_ki_protection
    async def __anext__(self) -> SequencedEvent | EventGap:
        await trio.lowlevel.checkpoint()
        if self._pending is not None:
            gap, self._pending = self._pending, None
            return gap
        if not await self.wait():
            raise StopAsyncIteration
        taken = self.take(1)
        return taken if isinstance(taken, EventGap) else taken[0]


__all__ = [
    "DEFAULT_EVENT_WINDOW",
    "MAX_ERA",
    "SEQ_BLOCK",
    "EventStream",
    "EventWindow",
    "event_window_size",
]
