"""The window of recent events and its seqs (actors/kernel/event_window.py), on its own: no runtime, no
database. A model (every event appended, with its seq) is checked against what readers resuming from any
seq are given, across block changes and the window's edge.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.actors.kernel.event_window import (
    MAX_ERA,
    SEQ_BLOCK,
    EventStream,
    EventWindow,
    event_window_size,
)
from onceflow.protocol import trusted
from onceflow.protocol.errors import ProtocolError
from onceflow.protocol.event_stream import MAX_EVENT_SEQ, EventGap, SequencedEvent
from onceflow.protocol.events import Event


def _event(n: int) -> Event:
    return trusted.diagnostic(level="info", code="n", fields={"n": n})


class Model:
    """A window under test, and every (seq, event) it was given, seqs read back at append time."""

    def __init__(self, size: int, era: int = 1, earlier: bool = False, block: int = 8) -> None:
        self.window = EventWindow(size, era=era, earlier=earlier, block=block)
        self.all: list[tuple[int, Event]] = []
        self.next_era = era + 1

    def append(self) -> None:
        event = _event(len(self.all))
        self.window.append(event)
        self.all.append((self.window.seq_of(self.window.count), event))

    def renew(self) -> None:
        """What `renew_eras_forever` does when the window asks: a fresh era, handed over."""
        if self.window.renewal.is_set():
            assert self.window.adopt(self.next_era)
            self.next_era += 2  # another runtime (PostgreSQL) took the one in between

    def held(self) -> list[tuple[int, Event]]:
        return self.all[-self.window.size :] if self.all else []


def _taken(stream: EventStream) -> list[tuple[int, Event]]:
    taken = stream.take(10**9)
    assert not isinstance(taken, EventGap)
    return [(item.seq, item.event) for item in taken]


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 12),
    earlier=st.booleans(),
    steps=st.lists(st.sampled_from(["append", "append", "append", "renew"]), max_size=80),
    pick=st.integers(0, 10**6),
    offset=st.integers(-3, 3),
)
def test_a_reader_resuming_after_any_seq_gets_the_held_events_after_it_once_in_order_or_a_gap(
    size: int, earlier: bool, steps: list[str], pick: int, offset: int
) -> None:
    model = Model(size, earlier=earlier)
    for step in steps:
        model.append() if step == "append" else model.renew()
    seqs = [seq for seq, _ in model.all]
    assert seqs == sorted(set(seqs))  # strictly increasing, across block changes
    assert all(seq > 1 * 8 for seq in seqs)  # above the era's start: no earlier stream's seq
    candidates = [0, 8, *seqs, *(s + offset for s in seqs)]
    after = max(0, candidates[pick % len(candidates)])

    stream = EventStream(model.window, after)
    held = model.held()
    got = _taken(stream)
    assert got == [(seq, event) for seq, event in held if seq > after]
    dropped = [seq for seq, _ in model.all[: len(model.all) - len(held)] if seq > after]
    before_stream = after <= 8 and earlier
    foreign = after > (seqs[-1] if seqs else 8)
    assert (stream.gap is not None) == bool(dropped or before_stream or foreign)
    if stream.gap is not None:
        assert stream.gap.after == after
        assert stream.gap.next == (got[0][0] if got else stream.next_seq)
    assert stream.caught_up
    model.append()  # then live: the next event, exactly once
    assert _taken(stream) == [model.all[-1]]


def test_a_reader_that_falls_more_than_the_window_behind_is_told_the_gap_and_goes_on_from_the_oldest() -> (
    None
):
    model = Model(4)
    stream = EventStream(model.window, None)
    for _ in range(3):
        model.append()
    assert [seq for seq, _ in _taken(stream)] == [seq for seq, _ in model.all]
    last = model.all[-1][0]
    for _ in range(10):
        model.append()
    gap = stream.take(100)
    assert gap == EventGap(last, model.held()[0][0])
    assert _taken(stream) == model.held()


def test_seqs_keep_increasing_when_a_block_runs_out_before_the_next_era_comes() -> None:
    model = Model(4, block=4)
    for _ in range(9):  # the renewal was asked for at 2 and never answered: on into the next era's seqs
        model.append()
    seqs = [seq for seq, _ in model.all]
    assert seqs == list(range(5, 14))
    model.window.adopt(3)  # era 3's block starts at 12, below the newest (13): never back
    model.append()
    assert model.all[-1][0] == 14


def test_seq_bounds_keep_every_seq_javascript_safe() -> None:
    assert (MAX_ERA + 1) * SEQ_BLOCK - 1 <= MAX_EVENT_SEQ
    window = EventWindow(2, era=MAX_ERA)
    window.append(_event(0))
    assert window.seq_of(1) <= MAX_EVENT_SEQ
    assert not window.adopt(MAX_ERA + 1)  # refused (logged): the current block goes on


@pytest.mark.parametrize("bad", [0, -1, 1_000_001, 2.0, True, "10"])
def test_a_window_size_out_of_range_is_refused_naming_event_window(bad: object) -> None:
    with pytest.raises(ValueError, match="event_window"):
        event_window_size(bad)


@pytest.mark.parametrize("bad", [-1, 1.0, True, "7", 2**63, [1]])
def test_a_bad_after_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ProtocolError) as raised:
        EventStream(EventWindow(2), bad)  # type: ignore[arg-type]
    assert raised.value.field == "after"


def test_an_int64_after_is_accepted_and_treated_as_a_position_of_another_stream() -> None:
    window = EventWindow(2, era=1)
    window.append(_event(0))
    stream = EventStream(window, 2**63 - 1)
    assert stream.gap == EventGap(2**63 - 1, window.seq_of(2))
    assert stream.next_seq == window.seq_of(2)


async def test_async_iteration_yields_the_gap_then_each_event_and_ends_when_the_window_closes() -> None:
    window = EventWindow(2, era=2, earlier=True)
    for n in range(3):
        window.append(_event(n))
    stream = EventStream(window, 0)
    window.close()
    items = [item async for item in stream]
    assert items == [
        EventGap(0, window.seq_of(2)),
        SequencedEvent(window.seq_of(2), _event(1)),
        SequencedEvent(window.seq_of(3), _event(2)),
    ]
