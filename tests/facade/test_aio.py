"""`onceflow.aio`: the runtime embedded in an asyncio program.

Each test is a plain function running its own `asyncio.run` (pytest-trio's trio_mode takes async tests).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from helpers import FIXTURES

import onceflow.aio
from onceflow.protocol.events import Event
from onceflow.protocol.host import SessionActionRequest
from onceflow.store.backends.lock import DatabaseOwnedError
from onceflow.testing import RecordingHost

WORKFLOW = FIXTURES / "workflows" / "minimal.yml"


@attrs.define
class SlowHost(RecordingHost):
    """Takes `delay` seconds (Trio time, on the runtime's thread: `host_loop="trio"`) for each session
    action."""

    delay: float = 0.3

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        await trio.sleep(self.delay)
        await super().perform_session_action(request)


def _create(task: str) -> dict[str, Any]:
    return {
        "type": "create_task",
        "task_id": task,
        "workflow_id": "fixture",
        "step_id": "todo",
        "session_id": "S",
    }


def _move(task: str) -> dict[str, Any]:
    return {"type": "move_task", "task_id": task, "step_id": "work"}


async def _registered(rt: onceflow.aio.AsyncioRuntime) -> None:
    reply = await rt.send(
        {"type": "register_workflow", "yaml": WORKFLOW.read_text(), "source": "minimal.yml"}
    )
    assert reply.ok, reply.error


async def _step(rt: onceflow.aio.AsyncioRuntime, task: str) -> str | None:
    reply = await rt.send({"type": "get_task", "task_id": task})
    return reply.result["step_id"] if reply.ok else None


def test_aio_concurrent_callers_under_asyncio_run(tmp_path: Path) -> None:
    async def main() -> None:
        async with onceflow.aio.open_runtime(tmp_path / "b.db") as rt:
            await _registered(rt)
            created = await asyncio.gather(*(rt.send(_create(f"T{n}")) for n in range(40)))
            moved = await asyncio.gather(*(rt.send(_move(f"T{n}")) for n in range(40)))
            assert all(r.ok for r in created + moved)
            assert {r.result["task_id"] for r in created} == {f"T{n}" for n in range(40)}
            steps = await asyncio.gather(*(_step(rt, f"T{n}") for n in range(40)))
            assert set(steps) == {"work"}

    asyncio.run(main())
    assert [t.name for t in threading.enumerate() if t.name == "onceflow-trio"] == []  # joined


def test_aio_cancelled_caller_still_gets_the_committed_effect_whole(tmp_path: Path) -> None:
    host = SlowHost()

    async def main() -> None:
        async with onceflow.aio.open_runtime(tmp_path / "b.db", host=host, host_loop="trio") as rt:
            await _registered(rt)
            assert (await rt.send(_create("T1"))).ok
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(rt.send(_move("T1")), timeout=0.01)  # the move is mid-way now
            assert host.session_actions == []  # the first session action is still sleeping
            assert await _step(rt, "T1") == "work"  # queued behind the move on the task's actor
            assert (await rt.send(_create("T2"))).ok
            await asyncio.wait_for(rt.send(_move("T2")), timeout=0.01)  # cancelled; context left at once

    with pytest.raises(TimeoutError):
        asyncio.run(main())
    # The abandoned commands ran to completion before the runtime closed: every entry's actions done.
    assert [(a.task_id, a.action) for a in host.session_actions] == [
        ("T1", "set_session_mode"),
        ("T1", "auto_start_agent"),
        ("T2", "set_session_mode"),
        ("T2", "auto_start_agent"),
    ]

    async def reopened() -> list[str | None]:
        async with onceflow.aio.open_runtime(tmp_path / "b.db") as rt:
            return [await _step(rt, "T1"), await _step(rt, "T2")]

    assert asyncio.run(reopened()) == ["work", "work"]


def test_aio_subscribe_streams_events_until_the_runtime_closes(tmp_path: Path) -> None:
    async def main() -> tuple[list[Event], list[Event]]:
        seen: list[Event] = []

        async def collect(events: onceflow.aio.Subscription) -> None:
            async for event in events:
                seen.append(event)

        async with onceflow.aio.open_runtime(tmp_path / "b.db") as rt:
            collector = asyncio.create_task(collect(rt.subscribe()))
            await _registered(rt)
            replies = [await rt.send(_create("T1")), await rt.send(_move("T1"))]
            ended = rt.subscribe()
            await ended.aclose()
            assert [e async for e in ended] == []
        await asyncio.wait_for(collector, timeout=5)  # the stream ended with the runtime
        return seen, [e for r in replies for e in r.events]

    seen, emitted = asyncio.run(main())
    assert seen == emitted
    assert {"task_created", "transition", "step_entered"} <= {e.type for e in seen}


def test_aio_open_errors_surface_as_themselves(tmp_path: Path) -> None:
    async def main() -> None:
        async with onceflow.aio.open_runtime(tmp_path / "b.db"):
            with pytest.raises(DatabaseOwnedError):
                async with onceflow.aio.open_runtime(tmp_path / "b.db"):
                    pass
        with pytest.raises(ValueError, match="actor_idle_timeout"):
            async with onceflow.aio.open_runtime(tmp_path / "c.db", actor_idle_timeout=-1):
                pass

    asyncio.run(main())
    assert [t.name for t in threading.enumerate() if t.name == "onceflow-trio"] == []


def test_aio_send_after_close_replies_shutting_down(tmp_path: Path) -> None:
    async def main() -> None:
        async with onceflow.aio.open_runtime(tmp_path / "b.db") as rt:
            pass
        reply = await rt.send({"type": "get_task", "task_id": "T1"})
        assert (reply.ok, reply.error and reply.error.code) == (False, "shutting_down")
        assert reply.command == "get_task"  # the refusal names the command it refused
        line = await rt.send(b'{"type": "list_tasks"}')
        assert (line.command, line.error and line.error.code) == ("list_tasks", "shutting_down")
        assert (await rt.send(b"not json")).command == "unknown"
        assert [e async for e in rt.subscribe()] == []

    asyncio.run(main())


def test_aio_leaving_the_context_drains_commands_submitted_but_not_awaited(tmp_path: Path) -> None:
    async def main() -> list[asyncio.Future[Any]]:
        async with onceflow.aio.open_runtime(tmp_path / "b.db") as rt:
            await _registered(rt)
            workflow = WORKFLOW.read_text().replace("id: fixture", "id: second")
            submitted = [rt.send({"type": "register_workflow", "yaml": workflow, "source": "second.yml"})]
            submitted += [rt.send(_create(f"T{n}")) for n in range(30)]
        return submitted

    submitted = asyncio.run(main())
    assert all(future.result().ok for future in submitted)  # answered, none cut off at shutdown

    async def reopened() -> Any:
        async with onceflow.aio.open_runtime(tmp_path / "b.db") as rt:
            steps = [await _step(rt, f"T{n}") for n in range(30)]
            second = await rt.send({**_create("X"), "workflow_id": "second"})
            return steps, second.ok

    assert asyncio.run(reopened()) == (["todo"] * 30, True)


def test_aio_cancelled_while_opening_still_closes_the_runtime_and_joins(tmp_path: Path) -> None:
    entered: list[float] = []

    async def open_and_hold(delay: float) -> None:
        async with onceflow.aio.open_runtime(tmp_path / "b.db"):
            entered.append(delay)
            await asyncio.sleep(60)

    async def main() -> None:
        for delay in (0.0, 0.001, 0.01):
            holder = asyncio.create_task(open_and_hold(delay))
            await asyncio.sleep(delay)
            holder.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(holder, timeout=10)
        async with onceflow.aio.open_runtime(tmp_path / "b.db") as rt:  # the file was released each time
            assert (await rt.send({"type": "get_task", "task_id": "none"})).error is not None

    asyncio.run(main())
    assert 0.0 not in entered  # that cancel landed while the runtime was still opening
    assert [t.name for t in threading.enumerate() if t.name == "onceflow-trio"] == []
