"""The supervisor restarts a crashed task actor and keeps serving every other task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from onceflow import open_runtime
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.task.actor import TaskActor
from onceflow.protocol import commands as c

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
"""


async def test_a_crashing_task_actor_is_logged_restarted_and_isolated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = TaskActor.handle

    async def crash_on_turn_start(self: TaskActor, command: Any, out: Outbox) -> Any:
        if isinstance(command, c.TurnStart):
            raise RuntimeError("boom")
        return await original(self, command, out)

    monkeypatch.setattr(TaskActor, "handle", crash_on_turn_start)
    structlog.reset_defaults()
    async with open_runtime(tmp_path / "db.sqlite") as rt:
        assert (await rt.send({"type": "register_workflow", "yaml": WORKFLOW})).ok
        for task in ("A", "B"):
            assert (await rt.send({"type": "create_task", "task_id": task, "workflow_id": "tiny"})).ok
        with capture_logs() as logs:
            crashed = await rt.send({"type": "turn_start", "task_id": "A"})
        assert not crashed.ok and crashed.error is not None and crashed.error.code == "internal"
        assert any(
            e["event"] == "task_actor_crashed" and e["task_id"] == "A" and e["log_level"] == "error"
            for e in logs
        )
        moved = await rt.send({"type": "move_task", "task_id": "A", "step_id": "doing"})
        assert moved.ok and moved.result["moved"] is True  # the restarted actor serves A again
        other = await rt.send({"type": "move_task", "task_id": "B", "step_id": "doing"})
        assert other.ok and other.result["step_id"] == "doing"
