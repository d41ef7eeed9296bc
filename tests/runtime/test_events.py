"""`Runtime.events(after=...)`: every event with its event_seq, a resume point that survives a reader's
crash and the runtime's restart, and a gap marker where events are gone. Real runtime, real database
(both backends: tests/postgres/BOTH_BACKENDS).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from helpers import FakeClock, create_task, move, setup_office

from onceflow.actors.kernel.event_window import EventStream
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.runtime.event_eras import renew_eras_forever
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol import trusted
from onceflow.protocol.errors import ProtocolError
from onceflow.protocol.event_stream import EventGap, SequencedEvent
from onceflow.protocol.events import Event
from onceflow.store.event_eras import next_era
from onceflow.store.writer import open_store


async def _moves(rt: Runtime, kandev_templates: Path, tasks: range) -> list[Event]:
    """Create the tasks and move each to work; every event the replies carried."""
    carried: list[Event] = []
    for n in tasks:
        carried += (await create_task(rt, f"T{n}")).events
        carried += (await move(rt, f"T{n}", "work")).events
    return carried


async def _drain(stream: EventStream) -> list[SequencedEvent | EventGap]:
    """What the stream holds now, without waiting for more."""
    items: list[SequencedEvent | EventGap] = []
    if stream.gap is not None:
        items.append(stream.gap)
    while not stream.caught_up:
        taken = stream.take(1000)
        items += [taken] if isinstance(taken, EventGap) else taken
    await trio.lowlevel.checkpoint()
    return items


async def test_events_carry_strictly_increasing_seqs_and_are_the_events_replies_carry(
    db_path: Path | str, kandev_templates: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        stream = rt.events()
        start = stream.next_seq
        carried = await _moves(rt, kandev_templates, range(5))
        items = await _drain(stream)
    assert all(isinstance(item, SequencedEvent) for item in items)
    seqs = [item.seq for item in items if isinstance(item, SequencedEvent)]
    assert [item.event for item in items if isinstance(item, SequencedEvent)] == carried
    assert seqs == list(range(start, start + len(carried)))  # one block: consecutive


async def test_events_after_a_seq_replay_what_is_held_then_go_live_each_event_once(
    db_path: Path | str, kandev_templates: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        everything = rt.events()
        await _moves(rt, kandev_templates, range(3))
        seen = await _drain(everything)
        crashed_at = seen[4]  # the reader processed five events, then crashed
        assert isinstance(crashed_at, SequencedEvent)
        resumed = rt.events(after=crashed_at.seq)
        assert resumed.gap is None and resumed.next_seq == crashed_at.seq + 1
        later = await _moves(rt, kandev_templates, range(3, 5))
        got: list[SequencedEvent | EventGap] = []
        async with trio.open_nursery() as nursery:

            async def read() -> None:
                async for item in resumed:
                    got.append(item)

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    assert got == seen[5:] + [SequencedEvent(seen[-1].seq + 1 + n, e) for n, e in enumerate(later)]  # type: ignore[union-attr]


async def test_a_reader_after_a_seq_older_than_the_window_is_told_the_gap_first(
    db_path: Path | str, kandev_templates: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock, event_window=5) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        start = rt.events().next_seq
        carried = await _moves(rt, kandev_templates, range(4))
        assert len(carried) > 10
        late = rt.events(after=start)  # processed the first event only; the window holds the last 5
        items = await _drain(late)
    newest = start + len(carried) - 1
    assert items == [EventGap(start, newest - 4)] + [
        SequencedEvent(newest - 4 + n, event) for n, event in enumerate(carried[-5:])
    ]
    assert late.gap == items[0]


async def test_a_reader_that_stops_reading_never_holds_the_runtime_back_and_learns_what_it_missed(
    db_path: Path | str, kandev_templates: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock, event_window=5) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        stalled = rt.events()
        carried = await _moves(rt, kandev_templates, range(4))  # never waits on the stalled reader
        items = await _drain(stalled)
    assert isinstance(items[0], EventGap)
    assert [item.event for item in items[1:]] == carried[-5:]  # type: ignore[union-attr]
    assert items[0].next == items[1].seq  # type: ignore[union-attr]


async def test_seqs_keep_increasing_across_a_restart_and_a_resume_from_before_it_gets_a_gap(
    db_path: Path | str, kandev_templates: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        stream = rt.events(after=0)
        assert stream.gap is None  # a fresh database: no stream came before this one
        await _moves(rt, kandev_templates, range(2))
        before = await _drain(stream)
    last = before[-1]
    assert isinstance(last, SequencedEvent)
    async with open_runtime(db_path, clock=clock) as rt:
        resumed = rt.events(after=last.seq)
        await _moves(rt, kandev_templates, range(2, 3))
        items = await _drain(resumed)
    gap = items[0]
    assert isinstance(gap, EventGap) and gap.after == last.seq
    after_restart = [item for item in items[1:] if isinstance(item, SequencedEvent)]
    assert len(after_restart) == len(items) - 1 > 0
    assert gap.next == after_restart[0].seq > last.seq  # never told it already saw newer events


async def test_events_refuse_a_bad_after_naming_the_field_and_open_runtime_a_bad_window(
    db_path: Path | str, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        for bad in (-1, 2**63, 1.5, True, "3"):
            with pytest.raises(ProtocolError) as raised:
                rt.events(after=bad)  # type: ignore[arg-type]
            assert raised.value.field == "after"
    for window in (0, 1_000_001, 2.5):
        with pytest.raises(ValueError, match="event_window"):
            async with open_runtime(db_path, clock=clock, event_window=window):  # type: ignore[arg-type]
                pass


async def test_subscribe_still_streams_plain_events_beside_events(
    db_path: Path | str, kandev_templates: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        plain, sequenced = rt.subscribe(), rt.events()
        carried = await _moves(rt, kandev_templates, range(2))
        items = await _drain(sequenced)
    assert [event async for event in plain] == carried == [i.event for i in items]  # type: ignore[union-attr]


async def test_a_new_era_is_taken_durably_once_half_a_block_is_used_and_seqs_jump_to_it(
    db_path: Path | str,
) -> None:
    """With blocks of 8 seqs: the 4th event asks for the next era, `renew_eras_forever` allocates it, and
    the following events are numbered in it; the eras are the database's (the next start gets a later
    one)."""
    async with open_store(db_path) as store, trio.open_nursery() as nursery:
        era = await store.transact(next_era)
        window = EventHub(size=100, era=era, block=8)  # `publish` inlines the window's append
        scope = await nursery.start(renew_eras_forever, store, window)
        seqs = []
        for n in range(20):
            window.publish(trusted.diagnostic(level="info", code="n", fields={"n": n}))
            seqs.append(window.seq_of(window.count))
            while window.renewal.is_set():  # asked: wait for the era to be allocated and handed over
                await trio.sleep(0.001)
        scope.cancel()
        later = await store.transact(next_era)
    eras = [era + n for n in range(5)]  # one runtime on the database: the counter's next values
    assert seqs == [e * 8 + k for e in eras for k in range(1, 5)]
    assert later == eras[-1] + 2  # the 20th event asked for a sixth era, taken too


def test_the_window_is_an_audience_once_the_runtime_serves() -> None:
    """Before: the start-up recovery scan may skip building events nobody could receive. After: a reader
    may resume over any event published, subscribed at that moment or not."""
    hub = EventHub()
    out = Outbox(hub, reply=False)
    assert not out.has_audience()
    hub.serving()
    assert out.has_audience()
