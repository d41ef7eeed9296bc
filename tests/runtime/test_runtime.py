"""The runtime as a whole: database ownership, failure isolation, concurrency, shutdown, events."""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing
from helpers import (
    REVIEWERS,
    FakeClock,
    create_task,
    diagnostics,
    events,
    list_entries,
    list_runs,
    move,
    ok,
    send,
    setup_office,
    step_of,
    to_review,
    turn_complete,
)

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Reply
from onceflow.protocol.host import SessionActionRequest
from onceflow.store.backends.lock import DatabaseOwnedError
from onceflow.testing import RecordingHost


@attrs.define
class FailingHost(RecordingHost):
    """Raises from every session action of the tasks in `broken`."""

    broken: set[str] = attrs.field(factory=set)

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        if request.task_id in self.broken:
            raise ConnectionError(f"session {request.session_id} is gone")
        await super().perform_session_action(request)


@attrs.define
class GatedHost(RecordingHost):
    """Holds every session action until `gate` is set; `entered` is set once one is waiting."""

    entered: trio.Event = attrs.field(factory=trio.Event)
    gate: trio.Event = attrs.field(factory=trio.Event)

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        self.entered.set()
        await self.gate.wait()
        await super().perform_session_action(request)


@attrs.define
@attrs.define
class BreakingClock:
    """The runtime's clock, raising once when armed: a fault outside onceflow's error types, inside a task
    actor. Put in place of `rt.services.clock` (the runtime reads the wall clock only at open)."""

    clock: Callable[[], float]
    armed: bool = False

    def __call__(self) -> float:
        if self.armed:
            self.armed = False
            raise RuntimeError("clock hardware fault")
        return self.clock()


async def test_second_runtime_on_the_same_file_fails_at_once(db_path: Path, clock: FakeClock) -> None:
    async with open_runtime(db_path, clock=clock) as first:
        await ok(first, {"type": "list_runs"})
        with trio.fail_after(2), pytest.raises(DatabaseOwnedError, match="already owned"):
            async with open_runtime(db_path, clock=clock):
                pytest.fail("a second runtime opened the same database")
        assert (await ok(first, {"type": "list_runs"})).result["runs"] == []  # the owner is unaffected
    async with open_runtime(db_path, clock=clock) as again:
        assert (await ok(again, {"type": "list_runs"})).result["runs"] == []


async def test_a_hard_link_to_a_live_runtimes_database_is_refused(db_path: Path, clock: FakeClock) -> None:
    linked = db_path.with_name("linked.db")
    async with open_runtime(db_path, clock=clock) as first:
        os.link(db_path, linked)
        with trio.fail_after(2), pytest.raises(DatabaseOwnedError, match="already owned"):
            async with open_runtime(linked, clock=clock):
                pytest.fail("a second runtime opened the database through a hard link")
        assert (await ok(first, {"type": "list_runs"})).result["runs"] == []  # the owner is unaffected
    assert not linked.with_name("linked.db-wal").exists()  # no second WAL was ever started
    async with open_runtime(linked, clock=clock) as again:  # free once the owner is gone
        assert (await ok(again, {"type": "list_runs"})).result["runs"] == []


# --- a single cause surfaces as itself -----------------------------------------


async def test_an_error_in_the_body_surfaces_as_itself_not_as_an_exception_group(
    db_path: Path, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError) as info:
        async with open_runtime(db_path):
            (tmp_path / "missing-template.yml").read_text()
    assert type(info.value) is FileNotFoundError
    assert info.value.__context__ is None  # no group chained onto it either


def break_the_workflows_table(conn: sqlite3.Connection) -> None:
    """Reading the registered workflows at start-up fails (a view calling an unknown SQL function)."""
    conn.execute("ALTER TABLE workflow_versions RENAME TO workflow_versions_real")
    conn.execute(
        "CREATE VIEW workflow_versions AS SELECT *, onceflow_no_such_function(1) AS broken"
        " FROM workflow_versions_real"
    )


async def test_a_runtime_that_fails_to_open_raises_the_single_cause(db_path: Path) -> None:
    async with open_runtime(db_path):
        pass
    conn = sqlite3.connect(db_path)
    with conn:
        break_the_workflows_table(conn)
    conn.close()
    with pytest.raises(sqlite3.OperationalError, match="onceflow_no_such_function"):
        async with open_runtime(db_path):
            pytest.fail("the runtime opened on a broken database")
    async with open_runtime(db_path.with_name("other.db")):  # the lock was released, nothing leaked
        pass


async def test_a_cause_keeps_its_own_context(db_path: Path) -> None:
    with pytest.raises(ValueError, match="bad value") as info:
        async with open_runtime(db_path):
            try:
                raise KeyError("first")
            except KeyError:
                raise ValueError("bad value") from None
    assert isinstance(info.value.__context__, KeyError)
    assert info.value.__suppress_context__


async def test_several_causes_stay_an_exception_group(db_path: Path) -> None:
    with pytest.raises(BaseExceptionGroup) as info:
        async with open_runtime(db_path):
            raise ExceptionGroup("two", [ValueError("a"), KeyError("b")])
    assert info.value.subgroup(ValueError) is not None  # neither cause is dropped
    assert info.value.subgroup(KeyError) is not None


async def test_a_cancelled_runtime_still_exits_through_its_cancel_scope(db_path: Path) -> None:
    with trio.move_on_after(0.05) as scope:
        async with open_runtime(db_path):
            await trio.sleep_forever()
    assert scope.cancelled_caught
    async with open_runtime(db_path):  # closed and released
        pass


async def test_failing_session_action_is_a_diagnostic_and_the_transition_stays(
    db_path: Path, kandev_templates: Path, clock: FakeClock
) -> None:
    host = FailingHost(broken={"T1"})
    async with open_runtime(db_path, host=host, clock=clock) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await create_task(rt, "T1")
        await create_task(rt, "T2")

        broken = await move(rt, "T1", "work")
        assert await step_of(rt, "T1") == "work"
        assert events(broken, "transition") and not events(broken, "session_action")
        [failure] = diagnostics(broken, "session_action_failed")
        assert failure.level == "error"
        assert (failure.fields["task_id"], failure.fields["action"]) == ("T1", "auto_start_agent")
        assert "ConnectionError" in failure.fields["cause"]
        assert (failure.fields["error_type"], failure.fields["error"]) == (
            "ConnectionError",
            "session session-T1 is gone",
        )

        healthy = await move(rt, "T2", "work")
        assert [a.task_id for a in events(healthy, "session_action")] == ["T2"]
        assert [r.task_id for r in host.session_actions] == ["T2"]
        assert (await turn_complete(rt, "T1")).result["to_step"] == "review"
        assert len(await list_runs(rt, task_id="T1")) == 2


async def test_crashed_task_actor_is_restarted_and_other_tasks_keep_serving(
    db_path: Path, kandev_templates: Path
) -> None:
    async with open_runtime(db_path) as rt:
        clock = rt.services.clock = BreakingClock(rt.services.clock)
        await setup_office(rt, kandev_templates / "office-default.yml")
        await create_task(rt, "T1")
        await create_task(rt, "T2")

        clock.armed = True
        crashed = await send(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
        assert not crashed.ok
        assert crashed.error.code == "internal"
        assert "clock hardware fault" in crashed.error.message

        with trio.fail_after(5):  # a dead actor would leave T1's mailbox unserved: a hang, not an error
            assert await step_of(rt, "T1") == "backlog"  # nothing of the failed command committed
            await to_review(rt, "T3")
            await move(rt, "T2", "work")
            await move(rt, "T1", "work")  # the same task is served by its restarted actor
            assert (await turn_complete(rt, "T1")).result["to_step"] == "review"
        assert {r["task_id"] for r in await list_runs(rt)} == {"T1", "T3"}


async def test_concurrent_commands_for_many_tasks(office: Runtime) -> None:
    task_ids = [f"T{n:02d}" for n in range(30)]

    async def drive(task_id: str) -> None:
        await create_task(office, task_id)
        await move(office, task_id, "work")
        async with trio.open_nursery() as twice:  # a duplicate turn_complete must not re-enter Review
            for _ in range(2):
                twice.start_soon(turn_complete, office, task_id)

    async with trio.open_nursery() as nursery:
        for task_id in task_ids:
            nursery.start_soon(drive, task_id)

    runs = await list_runs(office)
    assert len(runs) == 60
    assert len({r["idempotency_key"] for r in runs}) == 60
    for task_id in task_ids:
        assert await step_of(office, task_id) == "review"
        assert sorted(r["agent_profile_id"] for r in runs if r["task_id"] == task_id) == list(REVIEWERS)
        assert [(e["step_id"], e["entry_seq"]) for e in await list_entries(office, task_id)] == [
            ("review", 1)
        ]


async def test_commands_queued_at_shutdown_all_get_replies(
    db_path: Path, kandev_templates: Path, clock: FakeClock
) -> None:
    host = GatedHost()
    replies: dict[str, Reply] = {}

    async def record(name: str, message: dict) -> None:
        replies[name] = await send(rt, message)

    async def open_gate_while_closing() -> None:
        await trio.sleep(0.05)
        replies["late"] = await send(rt, {"type": "get_task", "task_id": "T1"})
        host.gate.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, open_runtime(db_path, host=host, clock=clock) as rt:
            await setup_office(rt, kandev_templates / "office-default.yml")
            await create_task(rt, "T1")
            await create_task(rt, "T2")
            nursery.start_soon(record, "move_t1", {"type": "move_task", "task_id": "T1", "step_id": "work"})
            await host.entered.wait()  # T1's actor is now busy; what follows queues behind it
            queued = {
                "turn_t1": {"type": "turn_complete", "task_id": "T1"},
                "move_t2": {"type": "move_task", "task_id": "T2", "step_id": "work"},
                "create_t3": {"type": "create_task", "task_id": "T3", "workflow_id": "office-default"},
            }
            for name, message in queued.items():
                nursery.start_soon(record, name, message)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(open_gate_while_closing)

    late = replies.pop("late")
    assert not late.ok and "shutting down" in late.error.message
    assert sorted(replies) == ["create_t3", "move_t1", "move_t2", "turn_t1"]
    assert all(reply.ok for reply in replies.values()), {n: r.error for n, r in replies.items()}
    assert replies["turn_t1"].result["to_step"] == "review"
    async with open_runtime(db_path, clock=clock) as rt:
        assert [await step_of(rt, t) for t in ("T1", "T2", "T3")] == ["review", "work", "work"]
        assert len(await list_runs(rt, task_id="T1")) == 2


async def test_subscribers_see_exactly_the_events_replies_carry(
    db_path: Path, kandev_templates: Path, clock: FakeClock
) -> None:
    carried = []
    async with open_runtime(db_path, clock=clock) as rt:
        stream = rt.subscribe()
        await setup_office(rt, kandev_templates / "office-default.yml")
        for reply in (
            await create_task(rt, "T1"),
            await move(rt, "T1", "work"),
            await turn_complete(rt, "T1"),
            await send(rt, {"type": "turn_complete", "task_id": "ghost"}),
            await send(
                rt,
                {
                    "type": "record_decision",
                    "task_id": "T1",
                    "step_id": "review",
                    "decider_type": "agent",
                    "decider_id": "rev-a",
                    "role": "reviewer",
                    "decision": "rejected",
                },
            ),
        ):
            carried.extend(reply.events)
    streamed = [event async for event in stream]  # the stream ends when the runtime closes
    assert len(carried) > 10
    assert streamed == carried


async def test_send_after_close_replies_instead_of_raising(db_path: Path, clock: FakeClock) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        pass
    task_reply = await send(rt, {"type": "get_task", "task_id": "T1"})
    assert not task_reply.ok
    runtime_reply = await send(rt, {"type": "list_runs"})
    assert not runtime_reply.ok


async def test_creating_a_task_at_its_start_step_is_not_an_entry_so_on_enter_is_the_hosts_job(
    office: Runtime, host: RecordingHost
) -> None:
    """office-default's start step (work) declares on_enter auto_start_agent. Creating a task there is not a
    step entry (spec: out of scope), so nothing of it runs: starting the agent at creation is the host's
    job. Entering the same step later does run it."""
    created = await create_task(office, "T1", step_id=None)
    assert await step_of(office, "T1") == "work"
    assert [e.type for e in created.events] == ["task_created"]
    assert host.session_actions == [] and await list_entries(office, "T1") == []
    await move(office, "T1", "backlog")
    entered = await move(office, "T1", "work")
    assert [(r.task_id, r.action) for r in host.session_actions] == [("T1", "auto_start_agent")]
    assert [e.step_id for e in events(entered, "step_entered")] == ["work"]


def test_switch_interval_holds_while_the_runtime_is_open_and_is_restored(tmp_path: Path) -> None:
    """`open_runtime(switch_interval=...)`: the GIL switch interval while open, the previous one after, even
    when the body raises; None leaves it alone."""
    before = sys.getswitchinterval()
    seen: list[float] = []

    async def main() -> None:
        async with open_runtime(tmp_path / "a.db") as rt:
            assert rt is not None
            seen.append(sys.getswitchinterval())
        with pytest.raises(KeyError):
            async with open_runtime(tmp_path / "b.db", switch_interval=0.00005):
                seen.append(sys.getswitchinterval())
                raise KeyError("body")

    trio.run(main)
    assert seen == [before, pytest.approx(0.00005)]  # the interpreter keeps it in microseconds
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_switch_interval_is_refused_before_anything_opens(tmp_path: Path, bad: float) -> None:
    async def main() -> None:
        async with open_runtime(tmp_path / "c.db", switch_interval=bad):
            pass

    with pytest.raises(ValueError, match="switch_interval"):
        trio.run(main)
    assert not (tmp_path / "c.db").exists()
