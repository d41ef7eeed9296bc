"""A runtime process SIGKILLed in the middle of `migrate_tasks` leaves each task wholly on one version: its
row, seats, runs, open entries and history all of v1 or all of v2. The next start recovers the entry the
kill interrupted, and replaying the migration moves the rest. Both backends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from helpers import OFFICE, create_task, move, ok, setup_office, to_review
from versions_support import Template, renamed, step, text

from onceflow.actors.runtime.startup import open_runtime
from onceflow.cli.views import open_read_only
from onceflow.testing import FakeClock, RecordingHost

CHILD = Path(__file__).with_name("migrate_child.py")
TASKS = [f"T{n}" for n in range(8)]  # even ones in review, odd ones in work (whose on_enter asks the host)


def renamed_asking_the_host() -> Template:
    """Review renamed peer-review, whose on_enter starts with a host action: a dispatch the kill can cut
    before its engine-owned actions ran (the entry record stays open)."""
    template = renamed()
    step(template, "peer-review")["events"]["on_enter"].insert(0, {"type": "auto_start_agent"})
    return template


V1 = {"backlog", "work", "review", "approval", "done"}
V2 = {"backlog", "work", "peer-review", "approval", "done"}


def snapshot(db: Path | str) -> dict[str, dict[str, Any]]:
    """Per task, read without a runtime: its version and step, the steps of its seats, of its unresolved
    runs and of its open entries, and its `migrated` history items."""
    with open_read_only(db) as conn:
        state: dict[str, dict[str, Any]] = {}
        for task_id, version, step_id in conn.execute(
            "SELECT id, workflow_version, workflow_step_id FROM tasks ORDER BY id"
        ).fetchall():

            def steps(sql: str, task_id: str = task_id) -> set[str]:
                return {row[0] for row in conn.execute(sql, (task_id,)).fetchall()}

            state[task_id] = {
                "version": int(version),
                "step": step_id,
                "seats": steps("SELECT step_id FROM participants WHERE task_id = ?"),
                "runs": steps(
                    "SELECT workflow_step_id FROM runs WHERE task_id = ? AND status IN ('queued', 'claimed')"
                ),
                "open": steps("SELECT step_id FROM step_entries WHERE task_id = ? AND terminal = 0"),
                "migrated": len(
                    steps("SELECT seq FROM task_history WHERE task_id = ? AND kind = 'migrated'")
                ),
            }
    return state


def assert_wholly_on_one_version(state: dict[str, dict[str, Any]]) -> None:
    for task_id, seen in state.items():
        steps = V2 if seen["version"] == 2 else V1
        assert seen["migrated"] == (1 if seen["version"] == 2 else 0), task_id
        assert {seen["step"]} | seen["seats"] | seen["runs"] | seen["open"] <= steps, (task_id, seen)


async def test_a_kill_mid_migration_leaves_each_task_wholly_on_one_version(
    db_path: Path | str, tmp_path: Path
) -> None:
    async with open_runtime(db_path, host=RecordingHost(), clock=FakeClock()) as rt:
        await setup_office(rt, Path(__file__).parents[1] / "fixtures" / "kandev" / "office-default.yml")
        for index, task_id in enumerate(TASKS):
            if index % 2 == 0:
                await to_review(rt, task_id)
            else:
                await create_task(rt, task_id)
                await move(rt, task_id, "work")
            await ok(
                rt, {"type": "add_participant", "task_id": task_id, "step_id": "review", "role": "watcher"}
            )
        changed = text(renamed_asking_the_host())
        await ok(rt, {"type": "register_workflow", "yaml": changed, "source": "office-default.yml"})

    marker = tmp_path / "hung"
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(db_path), str(marker), "3"],
        cwd=CHILD.parent,
        env={**os.environ, "PYTHONPATH": str(CHILD.parent.parent)},
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None, "the child exited before it hung"
            assert time.monotonic() < deadline, "the child never reached the second session action"
            time.sleep(0.05)
        hung_in = marker.read_text()
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()

    assert hung_in == "T2"  # every new entry asks the host: T0's, T1's, then T2's hung
    state = snapshot(db_path)
    assert_wholly_on_one_version(state)
    assert [t for t in TASKS if state[t]["version"] == 2] == ["T0", "T1", "T2"]
    assert state["T2"]["open"] == {"peer-review"}  # its new entry, cut mid-dispatch
    assert state["T2"]["runs"] == set()  # its fan-out comes after the host's answer

    host = RecordingHost()
    async with open_runtime(db_path, host=host, clock=FakeClock()) as rt:
        assert host.session_actions == []  # recovery re-runs engine-owned actions only (AC-B9)
        migrate = {
            "type": "migrate_tasks",
            "workflow_id": OFFICE,
            "to_version": 2,
            "step_map": {"review": "peer-review"},
            "enter": True,
            "operation_id": "crash-1",
        }
        replayed = (await ok(rt, migrate)).result
        assert [t["task_id"] for t in replayed["tasks"]] == ["T3", "T4", "T5", "T6", "T7"]
        assert (await ok(rt, migrate)).result["idempotent"] is True
    state = snapshot(db_path)
    assert_wholly_on_one_version(state)
    assert state["T2"]["runs"] == {"peer-review"}  # the start's recovery finished its entry on v2
    assert {seen["version"] for seen in state.values()} == {2}
    assert all(not seen["open"] for seen in state.values())
    assert {state[t]["step"] for t in TASKS} == {"peer-review", "work"}
