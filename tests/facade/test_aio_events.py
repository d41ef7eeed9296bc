"""`AsyncioRuntime.events(after=...)`: the resumable event stream on an asyncio loop (onceflow/aio.py
`EventSubscription`), over a real runtime on its own Trio thread."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from helpers import FIXTURES

import onceflow.aio
from onceflow.protocol.errors import ProtocolError
from onceflow.protocol.event_stream import EventGap, SequencedEvent
from onceflow.protocol.events import Event

WORKFLOW = FIXTURES / "workflows" / "minimal.yml"


async def _work(rt: onceflow.aio.AsyncioRuntime, tasks: range) -> list[Event]:
    """Register the fixture once, create each task and move it to work; the events the replies carried."""
    if tasks.start == 0:
        registered = await rt.send({"type": "register_workflow", "yaml": WORKFLOW.read_text(), "source": "m"})
        assert registered.ok
    carried: list[Event] = []
    for n in tasks:
        for message in (
            {"type": "create_task", "task_id": f"T{n}", "workflow_id": "fixture", "step_id": "todo"},
            {"type": "move_task", "task_id": f"T{n}", "step_id": "work"},
        ):
            reply = await rt.send(message)
            assert reply.ok, reply.error
            carried += reply.events
    return carried


def test_aio_events_resume_after_a_seq_each_event_once_through_cancelled_waits_and_end_at_close(
    tmp_path: Path,
) -> None:
    async def main() -> tuple[list[Any], list[Event]]:
        async with onceflow.aio.open_runtime(tmp_path / "b.db") as rt:
            everything = rt.events(after=0)  # a fresh database: no gap
            carried = await _work(rt, range(3))
            first = [await anext(everything) for _ in range(4)]  # then the reader "crashes"
            resumed = rt.events(after=first[-1].seq)
            got = [await anext(resumed) for _ in range(len(carried) - 4)]  # the replay
            with pytest.raises(TimeoutError):  # caught up: this wait is cancelled, its pull stays asked
                await asyncio.wait_for(anext(resumed), 0.2)
            carried += await _work(rt, range(3, 5))  # live: lands in the buffer, none lost
        got += [item async for item in resumed]  # the rest, then the end with the runtime
        return first + got, carried

    items, carried = asyncio.run(main())
    assert all(isinstance(item, SequencedEvent) for item in items)
    assert [item.event for item in items] == carried
    seqs = [item.seq for item in items]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_aio_events_start_with_a_gap_beyond_the_window_and_refuse_a_bad_after(tmp_path: Path) -> None:
    async def main() -> list[Any]:
        async with onceflow.aio.open_runtime(tmp_path / "b.db", event_window=3) as rt:
            with pytest.raises(ProtocolError) as raised:
                rt.events(after=-1)
            assert raised.value.field == "after"
            start = rt.events()
            carried = await _work(rt, range(2))
            head = await asyncio.wait_for(anext(start), 5)
            assert isinstance(head, EventGap)  # never read while 10 events passed a window of 3
            async with rt.events(after=0) as late:
                return [await anext(late) for _ in range(4)] + [carried]

    *items, carried = asyncio.run(main())
    gap, *held = items
    assert isinstance(gap, EventGap) and gap.after == 0 and gap.next == held[0].seq
    assert [item.event for item in held] == carried[-3:]
