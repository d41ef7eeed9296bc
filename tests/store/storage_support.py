"""The board the storage-fault tests share: 40 reviewers fanned out on entering Review.

Used by tests/store/test_storage_faults.py, tests/store/test_storage_full_disk.py and its child process.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from helpers import every_page, list_entries, list_runs, ok

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.writer import StoreActor

REVIEWERS = [f"rev-{n:02}" for n in range(40)]
BRIEF = "x" * 3000  # more than half a 4 KiB page: no two runs share one, so 40 runs need 40 new pages

BOARD = f"""
id: board
name: Board
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_turn_complete:
        - type: move_to_next
      on_agent_error:
        - type: move_to_step
          config: {{step_id: review}}
      on_comment:
        - type: queue_run
          config: {{target: primary, reason: comment, payload: {{brief: "{BRIEF * 3}"}}}}
  - id: review
    name: Review
    position: 1
    events:
      on_enter:
        - type: clear_decisions
        - type: queue_run_for_each_participant
          config: {{role: reviewer, reason: review, payload: {{brief: "{BRIEF}"}}}}
"""

# on_agent_error transitions are declared through the import path (evaluate-only-operation-marking.md).
REGISTER = {"type": "register_workflow", "yaml": BOARD, "source": "board.yml", "import_path": True}

UNLIMITED_PAGES = 4294967294  # SQLite's default max_page_count


async def cap_pages(store: StoreActor, extra: int | None) -> None:
    """Let the database grow by at most `extra` pages from now on (None: lift the cap).

    `max_page_count` belongs to the connection, so it is set through the writer's own connection.
    """

    def cap(conn: sqlite3.Connection) -> None:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        limit = UNLIMITED_PAGES if extra is None else pages + extra
        conn.execute(f"PRAGMA max_page_count={limit}").fetchone()

    await store.transact(cap)


def small_cache(conn: sqlite3.Connection) -> None:
    """Keep one page in memory (SQLite's floor applies), so a big transaction spills pages to the WAL as it
    goes and a full disk stops it mid fan-out, not only at COMMIT."""
    conn.execute("PRAGMA cache_size=1")


async def board(rt: Runtime) -> None:
    """The board with 40 reviewers, task T1 in Work and a stale rejection left at Review."""
    await ok(rt, REGISTER)
    for agent in REVIEWERS:
        await ok(
            rt,
            {
                "type": "add_participant",
                "workflow_id": "board",
                "step_id": "review",
                "role": "reviewer",
                "agent_profile_id": agent,
            },
        )
    await ok(
        rt,
        {
            "type": "create_task",
            "task_id": "T1",
            "workflow_id": "board",
            "step_id": "work",
            "primary_agent_id": "worker",
        },
    )
    await ok(
        rt,
        {
            "type": "record_decision",
            "task_id": "T1",
            "step_id": "review",
            "decider_type": "agent",
            "decider_id": "rev-00",
            "decision": "rejected",
        },
    )


async def state(rt: Runtime) -> dict[str, Any]:
    """Everything a half-commit could leave behind, read through the protocol."""
    return {
        "task": (await ok(rt, {"type": "get_task", "task_id": "T1"})).result,
        "runs": await list_runs(rt),
        "decisions": await every_page(
            rt, {"type": "list_decisions", "task_id": "T1"}, "decisions", "after_decision_id"
        ),
        "entries": await list_entries(rt, "T1"),
    }


def assert_reviewed_once(after: dict[str, Any]) -> None:
    """The board's turn_complete applied exactly once: T1 in Review, one run per reviewer from entry 1, the
    stale decision cleared, one terminal entry."""
    assert after["task"]["step_id"] == "review"
    assert sorted(run["agent_profile_id"] for run in after["runs"]) == REVIEWERS
    assert {run["idempotency_key"].split(":")[3] for run in after["runs"]} == {"1"}  # all of entry 1
    assert after["decisions"] == []  # the stale rejection was cleared
    [entry] = after["entries"]
    assert (entry["step_id"], entry["entry_seq"], entry["terminal"]) == ("review", 1, True)
