"""The task-row cache: a move starts from a cached row that the admission's compare-and-set verifies.

A cached task row (actors/kernel/task_rows.py): a cached row saves the move's read (one writer
request, at 1 task one commit); a row changed behind the cache fails the compare-and-set, nothing is
written, and the move is decided from a fresh read, preflight included, exactly once. The equivalence of
cached and uncached runs over random command sequences is in tests/on_enter/test_common_entry.py.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from helpers import FakeClock, ok, send

from onceflow.actors.kernel.task_rows import TaskRows
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.records import TaskRecord
from onceflow.testing import RecordingHost

WORKFLOW = """\
id: wf
name: WF
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
  - id: review
    name: Review
    position: 1
    wip_limit: 1
  - id: done
    name: Done
    position: 2
    events:
      on_enter:
        - type: clear_decisions
        - type: queue_run_for_each_participant
          config: {role: reviewer}
"""


@attrs.define
class PreflightHost(RecordingHost):
    """Records every preflight; refuses any transition out of `refuse_from`."""

    preflights: list[tuple[str, str, str]] = attrs.field(factory=list)
    refuse_from: str = ""

    async def preflight_transition(self, *, task_id: str, from_step: str, to_step: str) -> None:
        self.preflights.append((task_id, from_step, to_step))
        if from_step == self.refuse_from:
            raise RuntimeError(f"no transitions out of {from_step}")


async def setup(rt: Runtime, *tasks: str) -> None:
    await ok(rt, {"type": "register_workflow", "yaml": WORKFLOW, "source": "t.yml", "import_path": True})
    message = {"type": "add_participant", "workflow_id": "wf", "step_id": "done", "role": "reviewer"}
    await ok(rt, message | {"agent_profile_id": "rev-a"})
    for task_id in tasks:
        await ok(rt, {"type": "create_task", "task_id": task_id, "workflow_id": "wf"})


def rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_cached_row_mismatch_falls_back(tmp_path: Path) -> None:
    """The row changed behind the cache (moved to review, admission counted, in SQL): the cached move's
    compare-and-set fails and writes nothing; the move is re-read and re-preflighted and lands once, from
    the real source step. The stale preflight was refused (the host refuses moves out of work), and that
    refusal is not the answer: only the fresh row's preflight decides."""
    host = PreflightHost(refuse_from="work")

    async def main() -> Any:
        async with open_runtime(tmp_path / "t.db", clock=FakeClock(), host=host) as rt:
            await setup(rt, "T0")
            cached = rt.services.task_rows.get("T0")
            assert cached is not None and cached.step_id == "work"
            await rt.services.store.transact(
                lambda conn: (
                    conn.execute(
                        "UPDATE tasks SET workflow_step_id = 'review', admissions = admissions + 1"
                        " WHERE id = 'T0'"
                    ).rowcount
                )
            )
            return (await send(rt, {"type": "move_task", "task_id": "T0", "step_id": "done"})).model_dump()

    reply = trio.run(main)
    assert reply["ok"] and reply["result"] == {"moved": True, "step_id": "done"}
    assert host.preflights == [("T0", "work", "done"), ("T0", "review", "done")]
    transitions = [e for e in reply["events"] if e["type"] == "transition"]
    assert [(t["from_step"], t["to_step"]) for t in transitions] == [("review", "done")]
    db = tmp_path / "t.db"
    assert rows(db, "SELECT workflow_step_id, admissions FROM tasks") == [("done", 2)]
    assert rows(db, "SELECT step_id, entry_seq, terminal FROM step_entries") == [("done", 1, 1)]
    assert rows(db, "SELECT agent_profile_id FROM runs") == [("rev-a",)]


def test_a_counter_changed_behind_the_cache_is_caught_at_the_same_step(tmp_path: Path) -> None:
    """Same step, same workflow, only the admission counter moved on (another entry of the same step, as a
    promotion makes): the compare-and-set still refuses the cached row, and the fresh read decides."""
    host = PreflightHost()

    async def main() -> Any:
        async with open_runtime(tmp_path / "t.db", clock=FakeClock(), host=host) as rt:
            await setup(rt, "T0")
            await rt.services.store.transact(
                lambda conn: conn.execute("UPDATE tasks SET admissions = 7 WHERE id = 'T0'").rowcount
            )
            return (await send(rt, {"type": "move_task", "task_id": "T0", "step_id": "done"})).model_dump()

    reply = trio.run(main)
    assert reply["result"] == {"moved": True, "step_id": "done"}
    assert host.preflights == [("T0", "work", "done"), ("T0", "work", "done")]
    assert rows(tmp_path / "t.db", "SELECT admissions FROM tasks") == [(8,)]
    assert rows(tmp_path / "t.db", "SELECT COUNT(*) FROM step_entries") == [(1,)]


@pytest.mark.parametrize(("cache", "requests"), [(16384, 1), (0, 2)])
def test_a_cached_row_makes_a_move_one_writer_request(tmp_path: Path, cache: int, requests: int) -> None:
    """Not vacuous: with the cache, a move after create is the admission alone (one writer request, so at 1
    task one commit); without it, a read and then the admission."""

    async def main() -> int:
        async with open_runtime(tmp_path / "t.db", clock=FakeClock(), task_row_cache=cache) as rt:
            await setup(rt, "T0")
            store = rt.services.store
            calls: list[object] = []
            submit = store._submit  # every request, grouped or not, goes through it

            def counted(fn: Any, *args: Any) -> None:
                calls.append(fn)
                submit(fn, *args)

            store._submit = counted  # type: ignore[method-assign]
            await ok(rt, {"type": "move_task", "task_id": "T0", "step_id": "done"})
            del store._submit
            return len(calls)

    assert trio.run(main) == requests


def test_a_redelivered_move_is_answered_from_a_fresh_read(tmp_path: Path) -> None:
    """A move to the step the cache says the task is at is never answered from the cache: the row is read.
    Here the task left review behind the cache, so the move is a real entry, not a no-op."""

    async def main() -> Any:
        async with open_runtime(tmp_path / "t.db", clock=FakeClock()) as rt:
            await setup(rt, "T0")
            await ok(rt, {"type": "move_task", "task_id": "T0", "step_id": "done"})
            await rt.services.store.transact(
                lambda conn: (
                    conn.execute("UPDATE tasks SET workflow_step_id = 'work' WHERE id = 'T0'").rowcount
                )
            )
            return (await send(rt, {"type": "move_task", "task_id": "T0", "step_id": "done"})).model_dump()

    reply = trio.run(main)
    assert reply["result"] == {"moved": True, "step_id": "done"}
    assert rows(tmp_path / "t.db", "SELECT entry_seq FROM step_entries ORDER BY 1") == [(1,), (2,)]


def test_a_promotion_forgets_the_promoted_tasks_cached_row(tmp_path: Path) -> None:
    """A WIP promotion writes another task's row (outside its actor): that row leaves the cache. T1 is
    created queued at the full review step (its queued row cached); T0 leaving review promotes T1."""

    async def main() -> tuple[TaskRecord | None, TaskRecord | None, Any]:
        async with open_runtime(tmp_path / "t.db", clock=FakeClock()) as rt:
            await setup(rt, "T0")
            await ok(rt, {"type": "move_task", "task_id": "T0", "step_id": "review"})
            message = {"type": "create_task", "task_id": "T1", "workflow_id": "wf", "step_id": "review"}
            await ok(rt, message)
            before = rt.services.task_rows.get("T1")
            await ok(rt, {"type": "move_task", "task_id": "T0", "step_id": "done"})
            after = rt.services.task_rows.get("T1")
            moved = await send(rt, {"type": "move_task", "task_id": "T1", "step_id": "done"})
            return before, after, moved.model_dump()

    before, after, moved = trio.run(main)
    assert before is not None and not before.wip_admitted
    assert after is None or after.wip_admitted  # forgotten, or re-cached by its own admission since
    assert moved["result"] == {"moved": True, "step_id": "done"}


def test_task_row_cache_rejects_a_negative_size(tmp_path: Path) -> None:
    async def main() -> None:
        async with open_runtime(tmp_path / "t.db", task_row_cache=-1):
            pass  # pragma: no cover

    with pytest.raises(ValueError, match="task_row_cache"):
        trio.run(main)
    assert not (tmp_path / "t.db").exists()


def test_task_rows_hold_at_most_their_capacity_least_recently_used_first() -> None:
    def row(task_id: str) -> TaskRecord:
        return TaskRecord(task_id, "wf", "work", "", None, None, None, "medium", True, None, 0.0, 0.0)

    lru = TaskRows(2)
    lru.put(row("a"))
    lru.put(row("b"))
    assert lru.get("a") is not None  # a is now the most recently used
    lru.put(row("c"))
    assert (lru.get("a") is not None, lru.get("b"), lru.get("c") is not None) == (True, None, True)
    lru.forget("a")
    assert len(lru) == 1
    off = TaskRows(0)
    off.put(row("a"))
    assert off.get("a") is None
