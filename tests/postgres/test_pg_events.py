"""Event seqs on PostgreSQL: runtimes sharing one database each number their own stream in eras of their
own from the shared counter (store/event_eras.py), so their seqs never collide and a restart's are larger
than any seq before it."""

from __future__ import annotations

from pathlib import Path

from helpers import create_task, setup_office

from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.event_stream import EventGap, SequencedEvent


async def test_runtimes_on_one_database_number_their_events_in_eras_of_their_own(
    pg_url: str, kandev_templates: Path
) -> None:
    async with open_runtime(pg_url) as first:
        await setup_office(first, kandev_templates / "office-default.yml")
        async with open_runtime(pg_url) as second:  # loads the template at its start
            streams = [first.events(), second.events()]
            for n in range(3):
                await create_task(first, f"A{n}")
                await create_task(second, f"B{n}")
            seen = [[i.seq for i in stream.batch(100) if isinstance(i, SequencedEvent)] for stream in streams]
    eras = [{seq >> 24 for seq in seqs} for seqs in seen]
    assert all(len(seqs) == 3 for seqs in seen) and eras[0].isdisjoint(eras[1])
    async with open_runtime(pg_url) as again:
        resumed = again.events(after=max(seen[0] + seen[1]))
        assert isinstance(resumed.gap, EventGap)  # an earlier stream: a gap, never "already seen"
        assert resumed.next_seq > max(seen[0] + seen[1])
