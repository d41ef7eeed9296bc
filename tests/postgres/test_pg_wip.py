"""WIP limits with several runtimes on one PostgreSQL database.

Admissions into one WIP-limited step are serialized across runtimes by a transaction-scoped advisory lock
keyed by (workflow, step), taken before the occupancy count (store/entries/wip.py `serialize_admissions`).
Without it two transactions admitting different tasks each count the other's admission as uncommitted and both
see room.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import trio
from helpers import ok, register

from onceflow import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.backends import pg_schema, postgres
from onceflow.store.entries import wip

LIMIT = 2
RACE_FLOW = f"""
id: race
name: Race
steps:
  - {{id: backlog, name: Backlog, position: 0, is_start_step: true}}
  - {{id: narrow, name: Narrow, position: 1, wip_limit: {LIMIT}}}
  - id: gate
    name: Gate
    position: 2
    wip_limit: {LIMIT}
    pull_from_step_id: narrow
"""
RUNTIMES = 3
TASKS = 30  # per runtime and round


@contextlib.asynccontextmanager
async def runtimes(url: str) -> AsyncIterator[list[Runtime]]:
    async with contextlib.AsyncExitStack() as stack:
        opened = [await stack.enter_async_context(open_runtime(url)) for _ in range(RUNTIMES)]
        await register(opened[0], RACE_FLOW, "race.yml")
        for rt in opened[1:]:  # each runtime learns the template (registering again is idempotent)
            await register(rt, RACE_FLOW, "race.yml")
        yield opened


def admitted_at(url: str, step: str) -> int:
    with contextlib.closing(postgres.connect(url)) as conn:
        count = conn.scalar(
            "SELECT count(*) FROM tasks"
            " WHERE workflow_id = 'race' AND workflow_step_id = ? AND wip_admitted = 1",
            (step,),
        )
    return int(count)


async def test_wip_three_runtimes_moving_and_creating_into_one_step_never_over_admit(
    pg_url: str,
) -> None:
    """Three runtimes (three writer connections) move and create different tasks into one step with WIP
    limit 2, all at once, for several rounds: the step never holds more than 2 admitted tasks, every other
    task is queued there, and a gate pulling from it never holds more than its limit either."""
    async with runtimes(pg_url) as rts:
        for round_ in range(3):
            names = [[f"r{round_}-{n}-{i}" for i in range(TASKS)] for n in range(RUNTIMES)]
            async with trio.open_nursery() as nursery:
                for n, rt in enumerate(rts):  # backlog first, created by the runtime that moves them
                    for task in names[n]:
                        nursery.start_soon(
                            ok, rt, {"type": "create_task", "task_id": task, "workflow_id": "race"}
                        )
            async with trio.open_nursery() as nursery:
                for n, rt in enumerate(rts):
                    for task in names[n]:
                        nursery.start_soon(
                            ok, rt, {"type": "move_task", "task_id": task, "step_id": "narrow"}
                        )
                    for i in range(5):  # straight into the step, the _create admission path
                        created = {"type": "create_task", "task_id": f"c{round_}-{n}-{i}",
                                   "workflow_id": "race", "step_id": "narrow"}  # fmt: skip
                        nursery.start_soon(ok, rt, created)
            assert admitted_at(pg_url, "narrow") == LIMIT, round_
            async with trio.open_nursery() as nursery:  # free the slots from every runtime: promotions race
                for n, rt in enumerate(rts):
                    for task in names[n][:3]:
                        nursery.start_soon(ok, rt, {"type": "move_task", "task_id": task, "step_id": "gate"})
            assert admitted_at(pg_url, "narrow") <= LIMIT
            assert admitted_at(pg_url, "gate") <= LIMIT


@contextlib.contextmanager
def two_transactions(url: str) -> Iterator[tuple[Any, Any]]:
    """Two connections, each in a transaction, on a database holding task A and B in the backlog."""
    with (
        contextlib.closing(postgres.connect(url, lock_timeout=5)) as one,
        contextlib.closing(postgres.connect(url, lock_timeout=5)) as two,
    ):
        pg_schema.migrate(one)
        one.execute(
            "INSERT INTO workflows (id, name, source, definition, registered_at)"
            " VALUES ('race', 'r', 't', '{}', 0)"
        )
        for task in ("A", "B"):
            one.execute(
                "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
                " VALUES (?, 'race', 'backlog', 0, 0)",
                (task,),
            )
        one.execute("BEGIN")
        two.execute("BEGIN")
        yield one, two


def admit(conn: Any, task: str) -> bool:
    """One admission of `task` into `narrow` (limit 1), as the engine's move does: count, then claim."""
    if not wip.has_room(conn, "race", "narrow", 1, excluding=task):
        return False
    conn.execute("UPDATE tasks SET workflow_step_id = 'narrow', wip_admitted = 1 WHERE id = ?", (task,))
    return True


def test_wip_admission_waits_for_the_other_runtimes_admitting_transaction(pg_url: str) -> None:
    """Deterministic: while one transaction has admitted A into a step of limit 1 and not committed, a
    second one's room check for B blocks on the step's lock, then sees the step full once A commits."""
    with two_transactions(pg_url) as (one, two):
        assert admit(one, "A")
        answer: list[bool | BaseException] = []

        def second() -> None:
            try:
                answer.append(admit(two, "B"))
            except BaseException as exc:
                answer.append(exc)

        thread = threading.Thread(target=second)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive() and not answer  # waiting for A's transaction
        one.execute("COMMIT")
        thread.join(5)
        assert answer == [False]
        two.execute("COMMIT")
    assert admitted_at(pg_url, "narrow") == 1


def test_wip_without_the_step_lock_two_transactions_both_see_room(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: with `serialize_admissions` a no-op (the code before the fix), the same
    two transactions both admit into the step of limit 1, and both commit."""
    monkeypatch.setattr(wip, "serialize_admissions", lambda conn, workflow_id, step_id: None)
    with two_transactions(pg_url) as (one, two):
        assert admit(one, "A")
        assert admit(two, "B")
        one.execute("COMMIT")
        two.execute("COMMIT")
    assert admitted_at(pg_url, "narrow") == 2


def test_wip_step_lock_is_a_no_op_on_sqlite(tmp_path: Any) -> None:
    """SQLite's one writer serializes every transaction already: no statement is added there."""
    statements: list[str] = []
    with contextlib.closing(sqlite3.connect(tmp_path / "s.db")) as conn:
        conn.set_trace_callback(statements.append)
        wip.serialize_admissions(conn, "race", "narrow")
    assert statements == []
