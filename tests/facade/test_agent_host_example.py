"""The shipped agent-host example (onceflow/examples/agent_host.py) runs as a user runs it, from an empty
folder, and drives its task to Done through the runs worker: a rate-limited attempt retried, a rejection
sent back to Work, an approval."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import list_runs

from onceflow.actors.runtime.startup import open_runtime


async def test_the_agent_host_example_reaches_done(tmp_path: Path) -> None:
    db = tmp_path / "board.db"
    done = subprocess.run(
        [sys.executable, "-m", "onceflow.examples.agent_host", "--db", str(db)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    moves = [line for line in lines if line.startswith("FEAT-1: ")]
    assert moves == [
        "FEAT-1: backlog -> work (move_task)",
        "FEAT-1: work -> review (on_turn_complete)",
        "FEAT-1: review -> work (record_decision)",
        "FEAT-1: work -> review (on_turn_complete)",
        "FEAT-1: review -> done (record_decision)",
    ]
    assert lines[-1] == "FEAT-1 is at done"
    assert any(line.startswith("developer: run 1 failed, retry scheduled in ") for line in lines)
    async with open_runtime(db) as rt:
        rows = await list_runs(rt, task_id="FEAT-1")
    assert [(row["agent_profile_id"], row["status"], row["attempt"]) for row in rows] == [
        ("developer", "finished", 2),  # the rate-limited attempt, then the retry
        ("reviewer", "finished", 1),
        ("developer", "finished", 1),
        ("reviewer", "finished", 1),
    ]
