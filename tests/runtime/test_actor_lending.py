"""An idle task's command runs on its asker's own Trio task.

The actor model stays: a task's commands never overlap, one finishes before the next starts, nothing is lost
when senders race an eviction, a cancelled asker still completes its command, a crash is logged and the
queued commands are still served, and shutdown serves what is queued.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import structlog
import trio
import trio.testing
from helpers import FakeClock, ok, register
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.actors.task.actor import TaskActor
from onceflow.protocol import commands as c
from onceflow.store.backends import epochs
from onceflow.testing import RecordingHost

WORKFLOW = """
id: tiny
name: Tiny
steps:
  - id: todo
    name: Todo
    position: 0
    is_start_step: true
  - id: doing
    name: Doing
    position: 1
  - id: done
    name: Done
    position: 2
"""
STEPS = ("todo", "doing", "done")


class ProbeHost(RecordingHost):
    """A host whose preflight notes who runs it, checkpoints `pause` times (so other senders interleave)
    and, while `gate` is set, waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.inside: collections.Counter[str] = collections.Counter()
        self.peak: collections.Counter[str] = collections.Counter()
        self.ran_on: list[tuple[trio.lowlevel.Task, str | None]] = []
        self.pause = 0
        self.gate: trio.Event | None = None
        self.started = trio.Event()

    async def preflight_transition(self, *, task_id: str, from_step: str, to_step: str) -> None:
        self.inside[task_id] += 1
        self.peak[task_id] = max(self.peak[task_id], self.inside[task_id])
        self.ran_on.append((trio.lowlevel.current_task(), epochs.CURRENT_TASK.get()))
        self.started.set()
        try:
            for _ in range(self.pause):
                await trio.lowlevel.checkpoint()
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.inside[task_id] -= 1


async def _move(rt: Runtime, task_id: str, step_id: str) -> Any:
    return await ok(rt, {"type": "move_task", "task_id": task_id, "step_id": step_id})


async def _step(rt: Runtime, task_id: str) -> str:
    return str((await ok(rt, {"type": "get_task", "task_id": task_id})).result["step_id"])


async def _runtime_with(rt: Runtime, *task_ids: str) -> None:
    await register(rt, WORKFLOW)
    for task_id in task_ids:
        await ok(rt, {"type": "create_task", "task_id": task_id, "workflow_id": "tiny"})


async def test_an_idle_tasks_command_runs_on_the_askers_own_task(db_path: Path) -> None:
    host = ProbeHost()
    async with open_runtime(db_path, host=host, clock=FakeClock()) as rt:
        await _runtime_with(rt, "T1")
        assert epochs.CURRENT_TASK.get() is None
        await _move(rt, "T1", "doing")
        assert host.ran_on == [(trio.lowlevel.current_task(), "T1")]  # no actor spawned; the lock's task set
        assert epochs.CURRENT_TASK.get() is None  # and reset for the asker afterwards
        assert rt.live_actors == 0


_SENDER = st.tuples(st.integers(0, 5), st.sampled_from(STEPS), st.integers(0, 1))
_ROUND = st.lists(_SENDER, min_size=2, max_size=8)


async def test_racing_senders_are_serialized_per_task_and_none_is_lost(db_path: Path) -> None:
    """Hypothesis picks, per sender, how many checkpoints it waits before sending, its target step and its
    task (two tasks); the host's preflight checkpoints too. A task's commands never overlap, every sender is
    answered, and once all are answered no actor is left."""
    host = ProbeHost()
    host.pause = 2
    async with open_runtime(db_path, host=host, clock=FakeClock()) as rt:
        await _runtime_with(rt, "A", "B")
        rounds = 0

        async def play(senders: list[tuple[int, str, int]]) -> None:
            replies: list[Any] = []

            async def sender(delay: int, step: str, task: int) -> None:
                for _ in range(delay):
                    await trio.lowlevel.checkpoint()
                replies.append(await _move(rt, "AB"[task], step))

            async with trio.open_nursery() as nursery:
                for delay, step, task in senders:
                    nursery.start_soon(sender, delay, step, task)
            assert len(replies) == len(senders)
            await trio.testing.wait_all_tasks_blocked()
            assert rt.live_actors == 0

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(_ROUND)
        def run(senders: list[tuple[int, str, int]]) -> None:
            nonlocal rounds
            trio.from_thread.run(play, senders)
            rounds += 1

        await trio.to_thread.run_sync(run)
        assert rounds >= 10
        assert host.peak["A"] == 1 and host.peak["B"] == 1  # never two commands of one task at once
        assert sum(host.inside.values()) == 0


async def test_a_cancelled_asker_still_completes_its_lent_command_then_sees_the_cancellation(
    db_path: Path,
) -> None:
    """The command runs to its end shielded; the asker's `send` then raises `trio.Cancelled` (no reply)."""
    host = ProbeHost()
    async with open_runtime(db_path, host=host, clock=FakeClock()) as rt:
        await _runtime_with(rt, "T1")
        host.gate = gate = trio.Event()
        scope = trio.CancelScope()

        replies: list[Any] = []

        async def asker() -> None:
            with scope:
                replies.append(await _move(rt, "T1", "doing"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(asker)
            await host.started.wait()
            scope.cancel()  # the asker is cancelled mid-command
            await trio.testing.wait_all_tasks_blocked()
            assert not scope.cancelled_caught  # the command still runs
            gate.set()
        assert scope.cancelled_caught and replies == []  # delivered when the command was done
        host.gate = None
        assert await _step(rt, "T1") == "doing"  # the command ran to the end all the same
        assert rt.live_actors == 0


async def test_a_crash_in_a_lent_command_is_logged_and_the_queued_commands_are_served(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = TaskActor.handle
    crashing = trio.Event()

    async def crash_on_turn_start(self: TaskActor, command: Any, out: Outbox) -> Any:
        if isinstance(command, c.TurnStart):
            crashing.set()
            await trio.testing.wait_all_tasks_blocked()  # the move below is queued behind it
            raise RuntimeError("boom")
        return await original(self, command, out)

    monkeypatch.setattr(TaskActor, "handle", crash_on_turn_start)
    structlog.reset_defaults()
    async with open_runtime(db_path, clock=FakeClock()) as rt:
        await _runtime_with(rt, "T1")
        replies: dict[str, Any] = {}

        async def crash() -> None:
            replies["crash"] = await rt.send({"type": "turn_start", "task_id": "T1"})

        async def queued_move() -> None:
            await crashing.wait()
            replies["move"] = await rt.send({"type": "move_task", "task_id": "T1", "step_id": "doing"})

        with capture_logs() as logs:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(crash)
                nursery.start_soon(queued_move)
        assert replies["crash"].error.code == "internal"
        assert any(e["event"] == "task_actor_crashed" and e["task_id"] == "T1" for e in logs)
        assert replies["move"].ok and replies["move"].result == {"moved": True, "step_id": "doing"}
        await trio.testing.wait_all_tasks_blocked()
        assert rt.live_actors == 0


async def test_shutdown_waits_for_a_lent_command_and_serves_what_queued_behind_it(
    db_path: Path,
) -> None:
    host = ProbeHost()
    replies: list[Any] = []
    async with (
        trio.open_nursery() as outer,  # the senders outlive the runtime's body
        open_runtime(db_path, host=host, clock=FakeClock()) as rt,
    ):
        await _runtime_with(rt, "T1")
        host.gate = gate = trio.Event()

        async def mover(step: str) -> None:
            replies.append(await rt.send({"type": "move_task", "task_id": "T1", "step_id": step}))

        async def release_later() -> None:
            await trio.sleep(0.05)  # after the runtime's body has left and shutdown began
            gate.set()

        outer.start_soon(mover, "doing")
        await host.started.wait()
        outer.start_soon(mover, "done")  # queued behind the lent command
        await trio.testing.wait_all_tasks_blocked()
        outer.start_soon(release_later)
    assert [r.ok for r in replies] == [True, True]
    assert [r.result["step_id"] for r in replies] == ["doing", "done"]


async def test_cancelling_the_runtime_cancels_a_lent_command(db_path: Path) -> None:
    """A lent command is shielded from its asker's cancellation only: a cancelled runtime (a crash, as in
    AC-A8's test) ends it, as it ends spawned actors; its asker, cancelled too, sees `trio.Cancelled`."""
    host = ProbeHost()
    with trio.fail_after(10), trio.CancelScope() as crash:
        async with open_runtime(db_path, host=host, clock=FakeClock()) as rt:
            await _runtime_with(rt, "T1")
            host.gate = trio.Event()  # never set: the command would wait forever
            replies: list[Any] = []

            async def mover() -> None:
                try:
                    replies.append(await rt.send({"type": "move_task", "task_id": "T1", "step_id": "doing"}))
                except trio.Cancelled:
                    replies.append("cancelled")
                    raise

            async with trio.open_nursery() as nursery:
                nursery.start_soon(mover)
                await host.started.wait()
                crash.cancel()
    assert crash.cancelled_caught
    assert replies == ["cancelled"]  # ended, not left hanging


class _PlainHost(RecordingHost):
    """A RecordingHost subclass with an instance dict (no override of its own)."""


async def test_the_preflight_await_is_skipped_only_for_the_default_host(db_path: Path) -> None:
    """The engine skips awaiting `RecordingHost.preflight_transition` (it accepts everything); a preflight
    set on the host instance is still asked, and its refusal still refuses the move."""
    host = _PlainHost()

    async def refuse(*, task_id: str, from_step: str, to_step: str) -> None:
        raise RuntimeError("not now")

    host.preflight_transition = refuse  # type: ignore[method-assign]
    async with open_runtime(db_path, host=host, clock=FakeClock()) as rt:
        await _runtime_with(rt, "T1")
        reply = await rt.send({"type": "move_task", "task_id": "T1", "step_id": "doing"})
        assert reply.error is not None and reply.error.code == "transition_refused"
        assert await _step(rt, "T1") == "todo"
        assert rt.engine._asks_preflight
    async with open_runtime(db_path, clock=FakeClock()) as rt:  # the default RecordingHost
        assert not rt.engine._asks_preflight
        await _move(rt, "T1", "doing")
