"""Storage faults are typed refusals and never half-commit.

A full database is made in-process with a capped `PRAGMA max_page_count` on the writer's own connection
(SQLite then answers SQLITE_FULL and rolls the whole transaction back, as a full disk can); a busy one by a
second, plain sqlite3 connection holding `BEGIN IMMEDIATE` past the runtime's busy timeout. A real full disk
is exercised in tests/store/test_storage_full_disk.py.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from helpers import FakeClock, list_runs, ok, send
from storage_support import REGISTER, REVIEWERS, assert_reviewed_once, board, cap_pages, state
from structlog.testing import capture_logs

from onceflow.actors.engine.recovery import recover_open_entries
from onceflow.actors.kernel.outbox import EventHub
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.entries import step_entries
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, ActionContext, Effect
from onceflow.store.entries.wip import Promotion


def assert_typed_full(reply: Any) -> None:
    assert not reply.ok and reply.error is not None, reply
    assert (reply.error.code, reply.error.retryable) == ("storage_full", True), reply.error


@contextmanager
def no_actor_crash() -> Iterator[None]:
    """A storage fault is a typed refusal: no task actor may crash (and be restarted) over it."""
    with capture_logs() as logs:
        yield
    assert [r for r in logs if r["event"] in ("task_actor_crashed", "outcome_actor_crashed")] == []


async def test_storage_full_mid_fanout_commits_nothing_and_retry_is_exact(
    db_path: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        await board(rt)
        before = await state(rt)
        assert before["task"]["step_id"] == "work" and before["runs"] == [] and len(before["decisions"]) == 1

        # Each cap lets the admitting transaction get further (the step change, the entry, the clear, then
        # 0, 5, 10 ... of the 40 runs) before the database is full.
        with no_actor_crash():
            for extra in range(0, 40, 5):
                await cap_pages(rt.services.store, extra)
                reply = await send(rt, {"type": "turn_complete", "task_id": "T1"})
                assert_typed_full(reply)
                assert await state(rt) == before, f"a partial commit with {extra} pages to spare"

        # Space returns: the same command, sent again, does the whole thing exactly once.
        await cap_pages(rt.services.store, None)
        await ok(rt, {"type": "turn_complete", "task_id": "T1"})
        assert_reviewed_once(await state(rt))


async def test_storage_full_leaves_a_comment_unapplied_so_its_redelivery_after_space_returns_runs_once(
    db_path: Path, clock: FakeClock
) -> None:
    comment = {"type": "task_comment", "task_id": "T1", "comment_id": "C-1"}
    async with open_runtime(db_path, clock=clock) as rt:
        await board(rt)
        await cap_pages(rt.services.store, 0)
        with no_actor_crash():
            assert_typed_full(await send(rt, comment))
        assert (await ok(rt, {"type": "list_runs"})).result["runs"] == []

        await cap_pages(rt.services.store, None)
        redelivered = await ok(rt, comment)  # the operation id was not marked: it is evaluated again
        assert not redelivered.result.get("idempotent")
        assert (await ok(rt, comment)).result["idempotent"] is True  # marked once it committed
        [run] = (await ok(rt, {"type": "list_runs"})).result["runs"]
        assert (run["agent_profile_id"], run["reason"]) == ("worker", "comment")


async def test_storage_full_in_a_deferred_agent_error_transition_is_typed_and_leaves_it_unmarked(
    db_path: Path, clock: FakeClock
) -> None:
    error = {"type": "agent_error", "task_id": "T1", "run_id": "R-1", "execution_id": "X-1"}
    async with open_runtime(db_path, clock=clock) as rt:
        await board(rt)
        before = await state(rt)
        await cap_pages(rt.services.store, 0)
        with no_actor_crash():
            reply = await send(rt, error)
        assert_typed_full(reply)
        assert [e.code for e in reply.events if e.type == "diagnostic"] == ["deferred_commit_failed"]
        assert await state(rt) == before

        await cap_pages(rt.services.store, None)
        applied = await ok(rt, error)  # AC-EO-11: still unmarked, so the redelivery transitions
        assert applied.result["applied"] is True
        assert (await ok(rt, error)).result["idempotent"] is True
        after = await state(rt)
        assert after["task"]["step_id"] == "review" and len(after["runs"]) == len(REVIEWERS)


@contextmanager
def write_lock_held(db_path: Path) -> Iterator[None]:
    """Another connection (not the runtime's store) holds the database's write lock."""
    other = sqlite3.connect(db_path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield
        other.execute("ROLLBACK")
    finally:
        other.close()


OUTCOME = "outcome-" + "0" * 32

BUSY_COMMANDS: list[dict[str, Any]] = [
    # runtime-level: these raised sqlite3.OperationalError out of `send`
    REGISTER,
    {"type": "add_participant", "workflow_id": "board", "step_id": "review", "role": "reviewer"},
    {"type": "remove_participant", "participant_id": 1},
    {"type": "claim_run", "agent_profile_id": "worker"},
    {"type": "finish_run", "run_id": 1},
    {"type": "list_runs"},
    {"type": "get_outcome", "outcome_id": OUTCOME},
    {
        "type": "coordinator_ack",
        "store_ref": "city:c1",
        "outcome_id": OUTCOME,
        "work_id": "w1",
        "coordinator_fence": "f1",
        "acknowledged_by": "coordinator-1",
    },
    {"type": "list_tasks"},
    # task-level: these answered `internal` and restarted the task's actor
    {"type": "create_task", "task_id": "T2", "workflow_id": "board"},
    {"type": "get_task", "task_id": "T1"},
    {"type": "turn_complete", "task_id": "T1"},
    {"type": "move_task", "task_id": "T1", "step_id": "review"},
    {"type": "task_comment", "task_id": "T1", "comment_id": "C-1"},
    {"type": "agent_error", "task_id": "T1", "run_id": "R-1"},
    {
        "type": "record_decision",
        "task_id": "T1",
        "step_id": "review",
        "decider_type": "agent",
        "decider_id": "rev-01",
        "decision": "approved",
    },
    {"type": "add_participant", "task_id": "T1", "step_id": "review", "role": "reviewer"},
    {"type": "list_decisions", "task_id": "T1"},
    {"type": "list_step_entries", "task_id": "T1"},
    {"type": "update_task", "task_id": "T1", "title": "renamed"},
    {"type": "delete_task", "task_id": "T1"},
]


async def test_busy_database_answers_typed_busy_for_runtime_and_task_commands(
    db_path: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock, busy_timeout=0.05) as rt:
        await board(rt)
        before = await state(rt)
        answers: dict[str, tuple[str, bool] | None] = {}
        with no_actor_crash(), write_lock_held(db_path):
            for command in BUSY_COMMANDS:
                reply = await send(rt, command)
                label = f"{command['type']}{'@task' if 'task_id' in command else ''}"
                answers[label] = None if reply.error is None else (reply.error.code, reply.error.retryable)
        assert answers == {label: ("storage_busy", True) for label in answers}
        # The lock is gone: the runtime serves as before, and nothing of the refused commands landed.
        assert await state(rt) == before
        await ok(rt, {"type": "turn_complete", "task_id": "T1"})
        assert len(await list_runs(rt)) == len(REVIEWERS)


def fan_out_unavailable(conn: sqlite3.Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
    """A fan-out whose adapter fails transiently: no marker, the entry stays open for recovery (AC-B9(f))."""
    raise sqlite3.OperationalError("fan-out adapter unavailable")


TASKS = ["T1", "T2", "T3"]


async def open_entries_left(rt: Runtime) -> None:
    """T1..T3 entered Review while the fan-out adapter was down: three open entries, no runs."""
    rt.reconfigure(executors={**DEFAULT_EXECUTORS, "queue_run_for_each_participant": fan_out_unavailable})
    await board(rt)
    for task_id in TASKS[1:]:
        await ok(rt, {"type": "create_task", "task_id": task_id, "workflow_id": "board"})
    for task_id in TASKS:
        await ok(rt, {"type": "turn_complete", "task_id": task_id})
    assert len(await rt.services.store.transact(step_entries.open_entries)) == len(TASKS)
    rt.reconfigure(executors=DEFAULT_EXECUTORS)


async def assert_scan_commits_nothing_then_is_exact(
    rt: Runtime, restore: Callable[[], Awaitable[None]]
) -> None:
    store = rt.services.store
    with no_actor_crash():
        assert await recover_open_entries(rt.services, EventHub()) == 0
    assert await list_runs(rt) == []  # no entry after the failing one ran alone
    assert len(await store.transact(step_entries.open_entries)) == len(TASKS)

    await restore()
    assert await recover_open_entries(rt.services, EventHub()) == len(TASKS)
    runs = await list_runs(rt)  # every page: more runs than one page holds
    assert sorted((run["task_id"], run["agent_profile_id"]) for run in runs) == [
        (task_id, agent) for task_id in TASKS for agent in REVIEWERS
    ]
    assert await store.transact(step_entries.open_entries) == []


async def test_storage_full_during_the_recovery_scan_fails_its_batch_whole_and_a_later_scan_is_exact(
    db_path: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        await open_entries_left(rt)
        # Room for one entry's 40 runs and half the next: the scan's batch must not go on after the second.
        await cap_pages(rt.services.store, 60)
        await assert_scan_commits_nothing_then_is_exact(rt, lambda: cap_pages(rt.services.store, None))


ROLLBACK_AT_FINISH = """
CREATE TRIGGER rollback_at_finish BEFORE UPDATE OF terminal ON step_entries WHEN NEW.task_id = 'T2'
BEGIN SELECT RAISE(ROLLBACK, 'rolled back while finishing'); END
"""


async def test_a_transaction_sqlite_ends_while_an_entry_finishes_fails_the_recovery_batch_whole(
    db_path: Path, clock: FakeClock
) -> None:
    """Not a storage code at all: SQLite left the transaction (`in_transaction` is False), which is enough."""
    async with open_runtime(db_path, clock=clock) as rt:
        await open_entries_left(rt)
        store = rt.services.store
        await store.transact(lambda conn: conn.execute(ROLLBACK_AT_FINISH).fetchall())

        async def restore() -> None:
            await store.transact(lambda conn: conn.execute("DROP TRIGGER rollback_at_finish").fetchall())

        await assert_scan_commits_nothing_then_is_exact(rt, restore)


async def test_a_promotion_refused_for_a_busy_database_is_logged_not_swallowed(
    db_path: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock, busy_timeout=0.05) as rt:
        await board(rt)
        promotion = Promotion("T1", "board", "work", None)
        with capture_logs() as logs, write_lock_held(db_path):
            await rt._deliver_promotion(promotion, None)  # the forwarder's call for a committed promotion
        [refused] = [r for r in logs if r["event"] == "promotion_dispatch_refused"]
        assert (refused["task_id"], refused["step_id"], refused["code"]) == ("T1", "work", "storage_busy")
        assert [r for r in logs if r["event"] == "task_actor_crashed"] == []
