"""Creations of one writer batch into one step without a WIP limit are two statement runs for all of them
(`tasks.create_tasks`, the writer's `Grouped`), on both backends; a taken id (or one id twice) sends the
group back, and each creation then answers alone, exactly as it would have."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import FakeClock, ok, send

from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.commands import CreateTask
from onceflow.store.records import TaskRecord
from onceflow.store.tasks import tasks

WORKFLOW = """
id: made
name: Made
steps:
  - id: todo
    name: Todo
    position: 0
    is_start_step: true
"""


async def batch_of_creations(
    db_path: Path | str, monkeypatch: pytest.MonkeyPatch, task_ids: list[str]
) -> tuple[list[Any], list[Any], list[dict[str, Any]], list[list[Any]]]:
    """Create task A, then create `task_ids` as one writer batch (queued behind a request that holds the
    writer); return each creation's reply, what each group run returned (the ids, or None), each created
    task's row as stored afterwards (`task_info`) and its history items."""
    groups: list[Any] = []
    create_tasks = tasks.create_tasks

    def group_run(conn: Any, items: list[Any]) -> list[TaskRecord] | None:
        result = create_tasks(conn, items)
        groups.append(None if result is None else [row.id for row in result])
        return result

    monkeypatch.setattr(tasks, "create_tasks", group_run)
    async with open_runtime(db_path, clock=FakeClock()) as rt:
        await ok(rt, {"type": "register_workflow", "yaml": WORKFLOW, "source": "m.yml"})
        await ok(rt, {"type": "create_task", "task_id": "A", "workflow_id": "made", "title": "first"})
        store = rt.services.store
        release, started = threading.Event(), threading.Event()

        def hold(conn: Any) -> bool:
            started.set()
            return release.wait(10)

        replies: list[Any] = [None] * len(task_ids)

        async def create(index: int, task_id: str) -> None:
            command = {"type": "create_task", "task_id": task_id, "workflow_id": "made", "title": f"t{index}"}
            replies[index] = await send(rt, {**command, "priority": "high", "primary_agent_id": "p"})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.transact, hold)
            await trio.to_thread.run_sync(started.wait, 10)
            for index, task_id in enumerate(task_ids):
                nursery.start_soon(create, index, task_id)
                await trio.testing.wait_all_tasks_blocked()
            release.set()
        created = sorted({task_id for task_id in task_ids if task_id != "A"})
        rows = [tasks.task_info(await rt.engine.load_task(task_id)) for task_id in created]
        items = []
        for task_id in created:
            page = await ok(rt, {"type": "task_history", "task_id": task_id})
            items.append([(item["kind"], item["detail"]) for item in page.result["items"]])
    return replies, groups, rows, items


async def test_a_batch_of_creations_is_one_group_and_each_gets_its_stored_row(
    db_path: Path | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replies, groups, rows, items = await batch_of_creations(db_path, monkeypatch, ["C", "B", "D"])
    assert groups == [["C", "B", "D"]]  # one group run created all three, in order
    assert all(reply.ok for reply in replies)
    by_id = {reply.result["task_id"]: reply.result for reply in replies}
    assert [by_id[row["task_id"]] for row in rows] == rows  # the reply is the row as stored
    assert [row["title"] for row in rows] == ["t1", "t0", "t2"]
    assert all(row["priority"] == "high" and row["primary_agent_id"] == "p" for row in rows)
    created = {"workflow_id": "made", "workflow_version": 1, "step_id": "todo", "queued": False}
    assert items == [[("created", created)]] * 3


async def test_a_taken_id_sends_the_group_back_and_each_creation_answers_alone(
    db_path: Path | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replies, groups, rows, items = await batch_of_creations(db_path, monkeypatch, ["C", "A", "D"])
    assert groups == [None]
    assert [reply.ok for reply in replies] == [True, False, True]
    assert replies[1].error.code == "conflict" and replies[1].error.field == "task_id"
    assert [(row["task_id"], row["title"]) for row in rows] == [("C", "t0"), ("D", "t2")]
    assert all(len(history) == 1 for history in items)  # nothing of the rolled back group is left twice


async def test_one_id_twice_in_a_group_is_sent_back(db_path: Path | str) -> None:
    """(A task's own commands run one after another, so the runtime never groups one id twice; the group
    run still refuses it.)"""
    async with open_runtime(db_path, clock=FakeClock()) as rt:
        await ok(rt, {"type": "register_workflow", "yaml": WORKFLOW, "source": "m.yml"})
        workflow = rt.services.workflows.get("made")
        items = [
            (CreateTask(task_id=task_id, workflow_id="made"), 5.0, "made", workflow.start_step, 1)
            for task_id in ("E", "F", "E")
        ]
        assert await rt.services.store.transact(tasks.create_tasks, items) is None
