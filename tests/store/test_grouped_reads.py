"""Task-row reads of one writer batch are one statement (`tasks.get_tasks`, the writer's `Grouped`), on
both backends; a read of a missing task sends the group back, and each read then answers alone."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import FakeClock, ok

from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.errors import NotFoundError
from onceflow.store.records import TaskRecord
from onceflow.store.tasks import tasks
from onceflow.store.writer import Grouped

WORKFLOW = """
id: reads
name: Reads
steps:
  - id: todo
    name: Todo
    position: 0
    is_start_step: true
"""


async def batch_of_reads(db_path: Path | str, task_ids: list[str]) -> tuple[list[Any], list[Any]]:
    """Create tasks A and B, then read `task_ids` as one writer batch (queued behind a request that holds
    the writer); return each read's result (a row or the exception) and what each group run returned."""
    groups: list[Any] = []

    def group_run(conn: Any, ids: list[str]) -> list[TaskRecord] | None:
        result = tasks.get_tasks(conn, ids)
        groups.append(None if result is None else [row.id for row in result])
        return result

    async with open_runtime(db_path, clock=FakeClock()) as rt:
        await ok(rt, {"type": "register_workflow", "yaml": WORKFLOW, "source": "r.yml"})
        for task_id in ("A", "B"):
            await ok(rt, {"type": "create_task", "task_id": task_id, "workflow_id": "reads"})
        store = rt.services.store
        release, started = threading.Event(), threading.Event()

        def hold(conn: Any) -> bool:
            started.set()
            return release.wait(10)

        results: list[Any] = [None] * len(task_ids)

        async def read(index: int, task_id: str) -> None:
            try:
                results[index] = await store.transact_grouped(
                    Grouped("rows", task_id, group_run), tasks.get_task, task_id
                )
            except NotFoundError as exc:
                results[index] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.transact, hold)
            await trio.to_thread.run_sync(started.wait, 10)
            for index, task_id in enumerate(task_ids):
                nursery.start_soon(read, index, task_id)
                await trio.testing.wait_all_tasks_blocked()
            release.set()
    return results, groups


async def test_a_batch_of_reads_is_one_statement(db_path: Path | str) -> None:
    results, groups = await batch_of_reads(db_path, ["B", "A", "B"])
    assert groups == [["B", "A", "B"]]  # one group run answered all three, in order
    assert [row.id for row in results] == ["B", "A", "B"]
    assert all(row.step_id == "todo" and row.workflow_id == "reads" for row in results)


async def test_a_missing_task_sends_the_group_back_and_each_read_answers_alone(db_path: Path | str) -> None:
    results, groups = await batch_of_reads(db_path, ["A", "gone", "B"])
    assert groups == [None]
    assert [row.id for row in (results[0], results[2])] == ["A", "B"]
    assert isinstance(results[1], NotFoundError) and results[1].field == "task_id"


@pytest.mark.parametrize("ids", [[], ["A"]])
async def test_get_tasks_reads_what_it_is_given(db_path: Path | str, ids: list[str]) -> None:
    async with open_runtime(db_path, clock=FakeClock()) as rt:
        await ok(rt, {"type": "register_workflow", "yaml": WORKFLOW, "source": "r.yml"})
        await ok(rt, {"type": "create_task", "task_id": "A", "workflow_id": "reads"})
        rows = await rt.services.store.transact(tasks.get_tasks, ids)
    assert rows is not None and [row.id for row in rows] == ids
