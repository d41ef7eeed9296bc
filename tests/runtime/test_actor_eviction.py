"""Idle task actors are evicted and re-spawned on demand, without losing a message,
cancelling a command in flight, or forgetting anything committed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
import trio.testing
from helpers import FakeClock, create_task, move, ok, setup_office, step_of

from onceflow.actors.runtime.startup import open_runtime
from onceflow.testing import RecordingHost

IDLE = 5.0


async def elapse(clock: trio.testing.MockClock, seconds: float) -> None:
    """Move the Trio clock and let every timer that expired run (the store's thread is real, so time is
    advanced by hand rather than by an autojump clock, which would jump while a store reply is pending)."""
    await trio.testing.wait_all_tasks_blocked()
    clock.jump(seconds)
    await trio.testing.wait_all_tasks_blocked()


async def test_an_idle_actor_is_evicted_and_the_next_message_respawns_it(
    db_path: Path, kandev_templates: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_runtime(db_path, clock=FakeClock(), actor_idle_timeout=IDLE) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await create_task(rt, "T1")
        await create_task(rt, "T2")
        assert rt.live_actors == 2

        await elapse(mock_clock, IDLE / 2)
        await move(rt, "T1", "work")  # T1 is busy again: its idle time restarts
        await elapse(mock_clock, IDLE / 2 + 0.1)
        assert rt.live_actors == 1  # T2 idled a whole timeout, T1 did not

        await elapse(mock_clock, IDLE)
        assert rt.live_actors == 0
        assert await step_of(rt, "T1") == "work"  # re-spawned from committed state
        assert rt.live_actors == 1


async def test_a_zero_timeout_evicts_as_soon_as_the_mailbox_is_empty(
    db_path: Path, kandev_templates: Path
) -> None:
    async with open_runtime(db_path, clock=FakeClock(), actor_idle_timeout=0) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        for i in range(20):
            await create_task(rt, f"T{i}")
        await trio.testing.wait_all_tasks_blocked()
        assert rt.live_actors == 0
        for i in range(20):
            assert await step_of(rt, f"T{i}") == "backlog"


@pytest.mark.parametrize("offset", [-0.001, 0.0, 0.001])
@pytest.mark.parametrize("seed", range(5))
async def test_a_message_sent_at_the_eviction_deadline_is_never_lost(
    db_path: Path, kandev_templates: Path, mock_clock: trio.testing.MockClock, offset: float, seed: int
) -> None:
    rng = random.Random(seed)
    async with open_runtime(db_path, clock=FakeClock(), actor_idle_timeout=IDLE) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await create_task(rt, "T1")
        await trio.testing.wait_all_tasks_blocked()
        replies = []

        async def sender(checkpoints: int) -> None:
            for _ in range(checkpoints):  # interleave with the actor's own deadline wake-up differently
                await trio.lowlevel.checkpoint()
            replies.append(await ok(rt, {"type": "get_task", "task_id": "T1"}))

        mock_clock.jump(IDLE + offset)
        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(sender, rng.randrange(4))
        assert len(replies) == 10 and all(r.ok for r in replies)
        assert rt.live_actors <= 1


class SlowPreflightHost(RecordingHost):
    """A host whose preflight takes three idle timeouts; `sleeping` is set once it has started."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeping = trio.Event()

    async def preflight_transition(self, *, task_id: str, from_step: str, to_step: str) -> None:
        self.sleeping.set()
        await trio.sleep(3 * IDLE)


async def test_a_command_running_longer_than_the_idle_timeout_is_not_cancelled(
    db_path: Path, kandev_templates: Path, mock_clock: trio.testing.MockClock
) -> None:
    host = SlowPreflightHost()
    async with open_runtime(db_path, host=host, clock=FakeClock(), actor_idle_timeout=IDLE) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await create_task(rt, "T1")
        replies = []

        async def moving() -> None:
            replies.append(await move(rt, "T1", "work"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(moving)
            await host.sleeping.wait()  # the command is under way (its store reads took real time)
            for _ in range(4):  # four idle timeouts pass while it runs
                await elapse(mock_clock, IDLE)
        assert replies[0].result == {"moved": True, "step_id": "work"}
        assert await step_of(rt, "T1") == "work"


async def test_a_negative_idle_timeout_is_refused(db_path: Path) -> None:
    with pytest.raises(ValueError, match="actor_idle_timeout"):
        async with open_runtime(db_path, actor_idle_timeout=-1):
            pass  # pragma: no cover


@pytest.mark.parametrize("seed", range(10))
async def test_with_a_zero_timeout_racing_senders_never_lose_a_message(
    db_path: Path, kandev_templates: Path, seed: int
) -> None:
    rng = random.Random(seed)
    async with open_runtime(db_path, clock=FakeClock(), actor_idle_timeout=0) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await create_task(rt, "T1")
        replies = []

        async def sender(checkpoints: int) -> None:
            for _ in range(checkpoints):  # land on either side of an eviction
                await trio.lowlevel.checkpoint()
            replies.append(await ok(rt, {"type": "get_task", "task_id": "T1"}))

        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(sender, rng.randrange(6))
        assert len(replies) == 50
        await trio.testing.wait_all_tasks_blocked()
        assert rt.live_actors == 0


async def test_a_zero_timeout_evicts_without_a_cancel_scope_per_message(
    db_path: Path, kandev_templates: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the default timeout an emptied mailbox evicts its actor at once: no deadline is armed and no
    Cancelled is raised and caught per message (that cost ~10 % of an entry's CPU). Messages
    queued behind one another are still served by the same actor, in order."""
    armed: list[float] = []
    move_on_after = trio.move_on_after

    def spy(seconds: float, *, shield: bool = False) -> trio.CancelScope:
        armed.append(seconds)
        return move_on_after(seconds, shield=shield)

    async with open_runtime(db_path, clock=FakeClock(), actor_idle_timeout=0) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        monkeypatch.setattr(trio, "move_on_after", spy)
        await create_task(rt, "T1")
        async with trio.open_nursery() as nursery:  # three moves queued at once for one actor
            for step in ("work", "review", "work"):
                nursery.start_soon(move, rt, "T1", step)
        await trio.testing.wait_all_tasks_blocked()
        assert rt.live_actors == 0
        assert await step_of(rt, "T1") in ("work", "review")
    assert 0 not in armed
