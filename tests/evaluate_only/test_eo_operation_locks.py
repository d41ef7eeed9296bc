"""AC-EO-13: concurrent deliveries of one operation id are serialized from before the load to after the mark.

First `OperationLocks` on its own (two Trio tasks, deterministic via trio.testing), then the on_agent_error
caller: through the runtime, and through two task-actor instances sharing one lock table (bypassing the
mailbox, which already serializes a task's commands, so only the lock is under test).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import attrs
import pytest
import trio
import trio.testing
from eo_support import (
    OP,
    RUN,
    TASK,
    ScriptedHost,
    agent_error,
    applied,
    callbacks,
    moves,
    runs_for,
    setup,
    spy_ledger,
    step_of,
)
from helpers import ok

from onceflow.actors.kernel.operation_locks import OperationLocks, TaskLocks
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.actors.task import triggers as task_triggers
from onceflow.actors.task.actor import TaskActor
from onceflow.protocol import commands as c


@attrs.define
class Holder:
    """Holds `op` in `locks` until `release` is set; records when it got in and out."""

    locks: OperationLocks
    op: str
    log: list[str]
    release: trio.Event = attrs.field(factory=trio.Event)

    async def run(self, name: str) -> None:
        async with self.locks.hold(self.op):
            self.log.append(f"{name} in")
            await self.release.wait()
            self.log.append(f"{name} out")


async def test_ac_eo_13_same_operation_id_is_serialized() -> None:
    locks, log = OperationLocks(), []
    first, second = Holder(locks, "op", log), Holder(locks, "op", log)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(first.run, "first")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(second.run, "second")
        await trio.testing.wait_all_tasks_blocked()
        assert log == ["first in"]
        assert len(locks) == 1  # one entry, two holders (ref-counted)
        second.release.set()  # the waiter cannot go before the holder lets go
        await trio.testing.wait_all_tasks_blocked()
        assert log == ["first in"]
        first.release.set()
    assert log == ["first in", "first out", "second in", "second out"]
    assert len(locks) == 0  # removed after the last release


async def test_ac_eo_13_different_operation_ids_are_not_serialized() -> None:
    locks, log = OperationLocks(), []
    a, b = Holder(locks, "op-a", log), Holder(locks, "op-b", log)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.run, "a")
        nursery.start_soon(b.run, "b")
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(log) == ["a in", "b in"]
        assert len(locks) == 2
        a.release.set()
        b.release.set()
    assert len(locks) == 0


async def test_ac_eo_13_cancelled_holder_releases_the_lock() -> None:
    locks, log = OperationLocks(), []
    holder, waiter = Holder(locks, "op", log), Holder(locks, "op", log)
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            async with locks.hold("op"):
                nursery.start_soon(waiter.run, "waiter")  # queued behind this holder
                await trio.testing.wait_all_tasks_blocked()
                assert log == []
                scope.cancel()
                await trio.sleep_forever()  # cancelled here, while holding
        await trio.testing.wait_all_tasks_blocked()
        assert log == ["waiter in"]  # the cancelled holder's lock went to the waiter
        waiter.release.set()
    assert len(locks) == 0
    async with trio.open_nursery() as nursery:  # and the id is free again
        nursery.start_soon(holder.run, "again")
        await trio.testing.wait_all_tasks_blocked()
        holder.release.set()
    assert log[-2:] == ["again in", "again out"]


async def test_ac_eo_13_cancelled_waiter_drops_its_reference() -> None:
    locks, log = OperationLocks(), []
    holder = Holder(locks, "op", log)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder.run, "holder")
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(0.01):
            async with locks.hold("op"):
                pytest.fail("acquired a held lock")
        assert len(locks) == 1  # only the holder's reference is left
        holder.release.set()
    assert len(locks) == 0


async def test_ac_eo_13_concurrent_deliveries_through_the_runtime_transition_once(runtime: Runtime) -> None:
    """End to end (the task's mailbox serializes too; the actor-level tests below isolate the lock)."""
    await setup(runtime)
    replies = []

    async def deliver() -> None:
        replies.append(await agent_error(runtime))

    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(deliver)
    assert all(reply.ok for reply in replies)
    assert sorted(reply.result["idempotent"] for reply in replies) == [False, True]
    assert sum(len(moves(reply.events)) for reply in replies) == 1
    assert len(await runs_for(runtime, "fixer")) == 1
    assert await step_of(runtime) == "triage"


def actor(rt: Runtime, locks: OperationLocks) -> TaskActor:
    return TaskActor(TASK, rt.engine, TaskLocks(agent_error=locks))


async def handle(rt: Runtime, locks: OperationLocks, out: Outbox, results: list) -> None:
    results.append(await actor(rt, locks).handle(c.AgentError(task_id=TASK, run_id=RUN), out))


async def test_ac_eo_13_lock_is_held_across_the_commit_and_the_mark(
    runtime: Runtime, host: ScriptedHost, monkeypatch
) -> None:
    await setup(runtime)
    locks, results = OperationLocks(), []
    winner, racer = Outbox(EventHub()), Outbox(EventHub())
    host.gate = trio.Event()  # the winner's commit waits in the host's preflight
    async with trio.open_nursery() as nursery:
        nursery.start_soon(handle, runtime, locks, winner, results)
        await host.waiting.wait()
        spy = spy_ledger(monkeypatch, runtime)
        nursery.start_soon(handle, runtime, locks, racer, results)
        await trio.testing.wait_all_tasks_blocked()
        assert spy.checked == []  # the racer has not even checked the ledger ...
        assert racer.events == []  # ... nor evaluated anything
        host.gate.set()
    assert [r["idempotent"] for r in results] == [False, True]
    assert spy.marked == [OP]
    assert spy.checked == [OP]  # the racer's check, after the winner's mark
    assert callbacks(winner.events) == [("work", "queue_run", "done")]
    assert racer.events == []
    assert await step_of(runtime) == "triage"


async def test_ac_eo_13_lock_is_taken_before_the_task_is_loaded(runtime: Runtime) -> None:
    """A delivery blocked on the lock must evaluate the state committed while it waited, not a stale one."""
    await setup(runtime)
    locks, results, out = OperationLocks(), [], Outbox(EventHub())
    async with trio.open_nursery() as nursery, locks.hold(OP):  # another holder of the same id ...
        nursery.start_soon(handle, runtime, locks, out, results)
        await trio.testing.wait_all_tasks_blocked()
        assert out.events == []
        # ... commits the transition (without marking) while the delivery waits
        await ok(runtime, {"type": "move_task", "task_id": TASK, "step_id": "triage"})
    (result,) = results
    assert result["from_step"] == "triage"
    assert callbacks(out.events) == [("triage", "queue_run", "done")]
    assert await runs_for(runtime, "fixer") == []
    assert await applied(runtime)


def lock_tables(handler: str) -> set[str]:
    """The `ctx.locks.<table>` attributes a task trigger handler acquires operation locks through
    (`.hold(...)`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(task_triggers, handler))))
    return {
        node.func.value.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "hold"
        and isinstance(node.func.value, ast.Attribute)
    }


def test_ac_eo_13_agent_error_lock_is_not_the_child_completion_lock() -> None:
    agent_error_tables, children_tables = lock_tables("agent_error"), lock_tables("children_completed")
    assert agent_error_tables and children_tables
    assert agent_error_tables.isdisjoint(children_tables)
