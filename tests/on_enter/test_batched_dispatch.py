"""The batched shapes of dispatch keep the spec's failure rules.

- An entry's leading segment runs inside the admitting transaction, in a savepoint: when it fails, the move
  still stands and the entry stays open for the next start (AC-C4, AC-B9).
- The recovery scan handles entries `BATCH_SIZE` per store request: a record that fails rolls back alone,
  is logged with its identity and left open, while the rest of its batch and the later batches finish
  (AC-B9(f)).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from entry_support import (
    REVIEWERS,
    admit,
    entries_yaml,
    is_terminal,
    kinds_of,
    logged,
    new_task,
    on_disk,
    run_rows,
    setup_entries,
)
from helpers import move, ok, step_of
from structlog.testing import capture_logs
from test_common_entry import per_action_only

from onceflow.actors.runtime.startup import open_runtime
from onceflow.store.entries.recovery import BATCH_SIZE
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.tasks import tasks

FAN_OUT = """
- type: clear_decisions
- type: queue_run_for_each_participant
  config: {role: reviewer}
"""
KINDS = kinds_of(entries_yaml(FAN_OUT), "review")


def break_marker_reads(conn: sqlite3.Connection) -> None:
    """Replace step_entry_markers by a view whose SELECT fails at run time (an unknown SQL function)."""
    conn.execute("ALTER TABLE step_entry_markers RENAME TO step_entry_markers_real")
    conn.execute(
        "CREATE VIEW step_entry_markers AS SELECT *, onceflow_no_such_function(state) AS broken"
        " FROM step_entry_markers_real"
    )


def repair_marker_reads(conn: sqlite3.Connection) -> None:
    conn.execute("DROP VIEW step_entry_markers")
    conn.execute("ALTER TABLE step_entry_markers_real RENAME TO step_entry_markers")


async def test_ac_c4_a_failing_leading_segment_leaves_the_move_committed_and_the_entry_open(
    db_path: Path,
) -> None:
    key = EntryKey("T1", "review", 1)
    async with open_runtime(db_path) as rt:
        await setup_entries(rt, FAN_OUT)
        await new_task(rt, "T1")
        await rt.services.store.transact(break_marker_reads)
        # the per-action path's leading segment (the common entry reads no marker row: it writes its
        # done markers on the entry row)
        with capture_logs() as logs, per_action_only():
            reply = await move(rt, "T1", "review")
        assert reply.result == {"moved": True, "step_id": "review"}
        assert await step_of(rt, "T1") == "review"
        assert {r["event"] for r in logged(logs, "error")} >= {"leading_segment_failed"}
        assert all(r["task_id"] == "T1" for r in logged(logs, "error"))
        assert await rt.services.store.transact(lambda conn: run_rows(conn, "T1")) == []
        await rt.services.store.transact(repair_marker_reads)
        assert not await rt.services.store.transact(lambda conn: is_terminal(conn, key))

    async with open_runtime(db_path) as rt:  # the next start's recovery scan finishes it
        assert await rt.services.store.transact(lambda conn: is_terminal(conn, key))
        runs = await rt.services.store.transact(lambda conn: run_rows(conn, "T1"))
        assert sorted(agent for _, agent, _, _ in runs) == sorted(REVIEWERS)


TASKS = BATCH_SIZE + 44  # two batches
FAILING = "T-7"
BLOCK_CLOSE = (
    f"CREATE TRIGGER blocked BEFORE UPDATE OF terminal ON step_entries WHEN NEW.task_id = '{FAILING}'"
    " BEGIN SELECT RAISE(ABORT, 'database is locked'); END"
)


async def test_ac_b9_f_a_failing_record_rolls_back_alone_and_every_batch_finishes(db_path: Path) -> None:
    async with open_runtime(db_path) as rt:
        await setup_entries(rt, FAN_OUT)
        for i in range(TASKS):
            await new_task(rt, f"T-{i}")

    def crashed(conn: sqlite3.Connection) -> None:
        for i in range(TASKS):
            admit(conn, f"T-{i}", "review", KINDS)
        failing = tasks.get_task(conn, FAILING)  # it left review: its entry is closed, and the close fails
        tasks.move_task_step(
            conn,
            task_id=FAILING,
            expected_step_id="review",
            workflow_id=failing.workflow_id,
            step_id="work",
            now=0.0,
        )
        conn.execute(BLOCK_CLOSE)

    await on_disk(db_path, crashed)
    logs: list[dict[str, Any]] = []
    with capture_logs() as captured:
        async with open_runtime(db_path) as rt:
            logs.extend(captured)
            store = rt.services.store
            open_keys = await store.transact(
                lambda conn: [
                    row[0] for row in conn.execute("SELECT task_id FROM step_entries WHERE terminal = 0")
                ]
            )
            runs = await store.transact(lambda conn: run_rows(conn))
            await ok(rt, {"type": "get_task", "task_id": FAILING})  # the runtime serves
    assert open_keys == [FAILING]
    assert len(runs) == (TASKS - 1) * len(REVIEWERS)
    assert {r["task_id"] for r in logged(logs, "error", "recovery_entry_failed")} == {FAILING}

    await on_disk(db_path, lambda conn: conn.execute("DROP TRIGGER blocked"))
    async with open_runtime(db_path) as rt:
        assert await rt.services.store.transact(
            lambda conn: is_terminal(conn, EntryKey(FAILING, "review", 1))
        )
        assert len(await rt.services.store.transact(lambda conn: run_rows(conn))) == len(runs)
