"""The startup recovery scan over open step entries, and the transaction shape that makes it safe.

on-enter-action-dispatch.md: "Recovery — a bounded startup scan", AC-B9 (a1) (a2) (b) (c) (d) (e) (f), the
declaration digest, AC-B6, AC-B8, AC-A8's carve-out and the task-delete cascade. The state a crash leaves is
written through a plain store on the closed file (entry_support.admit / mark); `open_runtime` is the restart.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from entry_support import (
    CLEAR_AND_FAN_OUT,
    REVIEWERS,
    WF,
    add_decision,
    admit,
    commit_clear,
    decision_ids,
    entries_yaml,
    executors_with,
    is_terminal,
    key_entry_seq,
    kinds_of,
    logged,
    mark,
    new_task,
    on_disk,
    raising,
    run_rows,
    save_yaml,
    setup_entries,
    states,
)
from helpers import ok, register
from structlog.testing import capture_logs

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.entries import step_entries
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, ActionContext, Effect, Executor
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.tasks import tasks
from onceflow.testing import RecordingHost

THREE = """
- type: clear_decisions
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: r1}
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: r2}
"""
THREE_KINDS = kinds_of(entries_yaml(THREE), "review")
KEY = EntryKey("T1", "review", 1)


async def prepare(db_path: Path, review: str = THREE, task_ids: tuple[str, ...] = ("T1",)) -> None:
    """A first runtime: register `entries` (`review` as Review's on_enter), seat reviewers, add tasks."""
    async with open_runtime(db_path) as rt:
        await setup_entries(rt, review)
        for task_id in task_ids:
            await new_task(rt, task_id)


@asynccontextmanager
async def restart(
    db_path: Path, logs: list[dict[str, Any]] | None = None, **kwargs: Any
) -> AsyncIterator[Runtime]:
    """Open a runtime on the file (the recovery scan runs inside), capturing its logs into `logs`."""
    with capture_logs() as captured:
        async with open_runtime(db_path, **kwargs) as rt:
            if logs is not None:
                logs.extend(captured)
            yield rt


def loud_logs(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return logged(logs, "warning") + logged(logs, "error")


def move(conn: sqlite3.Connection, task_id: str, step_id: str) -> None:
    """A step change to a step that declares no engine-owned on_enter action (no record)."""
    task = tasks.get_task(conn, task_id)
    assert tasks.move_task_step(
        conn, task_id=task_id, expected_step_id=task.step_id, workflow_id=WF, step_id=step_id, now=0.0
    )


def keyed_runs(conn: sqlite3.Connection, task_id: str = "T1") -> list[tuple[int, str, str]]:
    """(entry_seq, reason, agent) of the task's runs, sorted."""
    return sorted((key_entry_seq(key), reason, agent) for _, agent, reason, key in run_rows(conn, task_id))


def full(entry_seq: int = 1, reasons: tuple[str, ...] = ("r1", "r2")) -> list[tuple[int, str, str]]:
    return sorted((entry_seq, reason, agent) for reason in reasons for agent in REVIEWERS)


# --- AC-B9: resume --------------------------------------------------------------------------------


async def test_ac_b9_the_scan_resumes_at_the_first_open_position_and_reclaims_a_stale_claim(
    db_path: Path,
) -> None:
    await prepare(db_path)

    def crashed_mid_entry(conn: sqlite3.Connection) -> int:
        add_decision(conn, "T1", "review")  # from before the entry: the committed clear deleted it
        key = admit(conn, "T1", "review", THREE_KINDS)
        commit_clear(conn, key)
        later = add_decision(conn, "T1", "review", "rev-b")
        mark(conn, key, 1, "queue_run_for_each_participant", "in_progress", epoch="old-epoch")
        return later

    later = await on_disk(db_path, crashed_mid_entry)
    logs: list[dict[str, Any]] = []
    async with restart(db_path, logs) as rt:
        store = rt.services.store
        assert rt.epoch != "old-epoch"
        assert await store.transact(lambda conn: states(conn, KEY)) == [
            (0, "clear_decisions", "done"),
            (1, "queue_run_for_each_participant", "done"),
            (2, "queue_run_for_each_participant", "done"),
        ]
        assert await store.transact(lambda conn: is_terminal(conn, KEY))
        assert await store.transact(keyed_runs) == full()
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == [later]  # no re-clear
    assert loud_logs(logs) == []


async def test_ac_b9_an_entry_with_no_markers_runs_from_its_first_engine_action(db_path: Path) -> None:
    await prepare(db_path)
    before = await on_disk(db_path, lambda conn: add_decision(conn, "T1", "review"))
    await on_disk(db_path, lambda conn: admit(conn, "T1", "review", THREE_KINDS))
    async with restart(db_path) as rt:
        store = rt.services.store
        assert before not in await store.transact(lambda conn: decision_ids(conn, "T1", "review"))
        assert await store.transact(keyed_runs) == full()
        assert await store.transact(lambda conn: is_terminal(conn, KEY))


# --- AC-B9 (a1), (a2) -----------------------------------------------------------------------------


async def test_ac_b9_a1_an_entry_the_task_has_left_is_closed_step_left_and_not_run(db_path: Path) -> None:
    await prepare(db_path)

    def left_the_step(conn: sqlite3.Connection) -> int:
        key = admit(conn, "T1", "review", THREE_KINDS)
        mark(conn, key, 0, "clear_decisions", "in_progress")
        decision = add_decision(conn, "T1", "review")
        move(conn, "T1", "done")
        return decision

    decision = await on_disk(db_path, left_the_step)
    async with restart(db_path) as rt:
        store = rt.services.store
        assert await store.transact(lambda conn: is_terminal(conn, KEY))
        marks = await store.transact(lambda conn: step_entries.markers(conn, KEY))
        assert [(m.position, m.state, m.detail) for m in marks.values()] == [
            (0, "skipped", "step_left"),
            (1, "skipped", "step_left"),
            (2, "skipped", "step_left"),
        ]
        assert await store.transact(run_rows) == []
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == [decision]


async def test_ac_b9_a2_superseded_entry_is_skipped_and_the_newer_entry_resumes(db_path: Path) -> None:
    await prepare(db_path)
    newer = EntryKey("T1", "review", 2)

    def left_and_returned(conn: sqlite3.Connection) -> int:
        older = admit(conn, "T1", "review", THREE_KINDS)
        mark(conn, older, 0, "clear_decisions", "in_progress", epoch="old-epoch")
        move(conn, "T1", "work")
        assert admit(conn, "T1", "review", THREE_KINDS) == newer
        commit_clear(conn, newer)
        return add_decision(conn, "T1", "review")  # a vote of the live round

    vote = await on_disk(db_path, left_and_returned)
    async with restart(db_path) as rt:
        store = rt.services.store
        marks = await store.transact(lambda conn: step_entries.markers(conn, KEY))
        assert {(m.state, m.detail) for m in marks.values()} == {("skipped", "superseded")}
        assert await store.transact(lambda conn: is_terminal(conn, KEY))
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == [vote]  # older clear
        assert await store.transact(keyed_runs) == full(entry_seq=2)
        assert await store.transact(lambda conn: is_terminal(conn, newer))


async def test_ac_b9_a2_an_older_open_entry_is_superseded_even_when_the_newer_one_completed(
    db_path: Path,
) -> None:
    # Rule (f) leaves a transiently failed entry open; the task leaves and returns before the next start.
    async with open_runtime(
        db_path, executors=executors_with(clear_decisions=raising("clear_decisions", times=1))
    ) as rt:
        await setup_entries(rt, THREE)
        await new_task(rt, "T1")
        for step_id in ("review", "work", "review"):
            await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": step_id})
        store = rt.services.store
        assert not await store.transact(lambda conn: is_terminal(conn, KEY))  # entry 1's clear failed
        assert await store.transact(lambda conn: is_terminal(conn, EntryKey("T1", "review", 2)))
        vote = await store.transact(lambda conn: add_decision(conn, "T1", "review"))

    async with restart(db_path) as rt:
        store = rt.services.store
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == [vote]
        assert await store.transact(keyed_runs) == full(entry_seq=2)  # no second fan-out for entry 1
        marks = await store.transact(lambda conn: step_entries.markers(conn, KEY))
        assert {(m.state, m.detail) for m in marks.values()} == {("skipped", "superseded")}


# --- AC-B9 (b), (c) -------------------------------------------------------------------------------


async def test_ac_b9_b_an_entry_whose_clear_decisions_failed_is_closed_not_resumed(db_path: Path) -> None:
    await prepare(db_path)

    def clear_failed(conn: sqlite3.Connection) -> int:
        key = admit(conn, "T1", "review", THREE_KINDS)
        step_entries.finish_marker(conn, key, 0, "clear_decisions", "failed", "disk I/O error", 0.0)
        return add_decision(conn, "T1", "review")

    stale = await on_disk(db_path, clear_failed)
    async with restart(db_path) as rt:
        store = rt.services.store
        assert await store.transact(lambda conn: is_terminal(conn, KEY))
        assert await store.transact(lambda conn: states(conn, KEY)) == [(0, "clear_decisions", "failed")]
        assert await store.transact(run_rows) == []  # no fan-out against uncleared decisions
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == [stale]


async def test_ac_b9_c_records_are_processed_in_task_step_entry_seq_order(db_path: Path) -> None:
    await prepare(db_path, task_ids=("T2", "T3", "T1"))
    for task_id in ("T3", "T1", "T2"):  # allocated out of order
        await on_disk(db_path, lambda conn, t=task_id: admit(conn, t, "review", THREE_KINDS))
    async with restart(db_path) as rt:
        rows = await rt.services.store.transact(run_rows)
    assert [task_id for task_id, *_ in rows] == ["T1"] * 4 + ["T2"] * 4 + ["T3"] * 4


# --- AC-B9 (d): the declaration digest ------------------------------------------------------------


async def test_ac_b9_d_an_action_inserted_earlier_terminalises_the_entry_without_a_second_clear(
    db_path: Path,
) -> None:
    before = entries_yaml(CLEAR_AND_FAN_OUT)
    after = entries_yaml("- type: clear_decisions" + CLEAR_AND_FAN_OUT)  # [clear, clear, fan-out]
    await prepare(db_path, CLEAR_AND_FAN_OUT)

    def cleared_then_synced(conn: sqlite3.Connection) -> int:
        key = admit(conn, "T1", "review", kinds_of(before, "review"))
        commit_clear(conn, key)
        vote = add_decision(conn, "T1", "review")
        save_yaml(conn, WF, after)
        return vote

    vote = await on_disk(db_path, cleared_then_synced)
    logs: list[dict[str, Any]] = []
    async with restart(db_path, logs) as rt:
        store = rt.services.store
        marks = await store.transact(lambda conn: step_entries.markers(conn, KEY))
        assert [(m.position, m.kind, m.state, m.detail) for m in marks.values()] == [
            (0, "clear_decisions", "done", ""),
            (1, "clear_decisions", "skipped", "declaration_changed"),
            (2, "queue_run_for_each_participant", "skipped", "declaration_changed"),
        ]
        assert await store.transact(lambda conn: is_terminal(conn, KEY))
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == [vote]
        assert await store.transact(run_rows) == []
    [warning] = loud_logs(logs)
    assert warning["log_level"] == "warning"
    assert (warning["workflow_id"], warning["step_id"], warning["task_id"]) == (WF, "review", "T1")
    assert warning["recorded_digest"] == step_entries.declaration_digest(kinds_of(before, "review"))
    assert warning["current_digest"] == step_entries.declaration_digest(kinds_of(after, "review"))


async def test_ac_b9_d_an_action_removed_executes_no_position_under_another_actions_marker(
    db_path: Path,
) -> None:
    await prepare(db_path)
    after = entries_yaml(THREE.split("- type: clear_decisions", 1)[1])  # [fan-out r1, fan-out r2]

    def half_done_then_synced(conn: sqlite3.Connection) -> None:
        key = admit(conn, "T1", "review", THREE_KINDS)
        commit_clear(conn, key)
        step_entries.finish_marker(conn, key, 1, "queue_run_for_each_participant", "done", "", 0.0)
        save_yaml(conn, WF, after)

    await on_disk(db_path, half_done_then_synced)
    logs: list[dict[str, Any]] = []
    async with restart(db_path, logs) as rt:
        store = rt.services.store
        assert await store.transact(run_rows) == []  # neither r1 again (at 0) nor r2 under r1's marker
        marks = await store.transact(lambda conn: step_entries.markers(conn, KEY))
        assert {(m.position, m.kind) for m in marks.values() if m.state == "done"} == {
            (0, "clear_decisions"),
            (1, "queue_run_for_each_participant"),
        }
        assert await store.transact(lambda conn: is_terminal(conn, KEY))
    assert [(r["log_level"], r["task_id"]) for r in loud_logs(logs)] == [("warning", "T1")]


async def test_ac_b9_d_a_config_change_with_kinds_and_order_unchanged_keeps_the_entry_going(
    db_path: Path,
) -> None:
    old = CLEAR_AND_FAN_OUT.replace("reason: wake", "reason: old")
    new = CLEAR_AND_FAN_OUT.replace("reason: wake", "reason: new")
    flaky = executors_with(queue_run_for_each_participant=raising("queue_run_for_each_participant"))
    async with open_runtime(db_path, executors=flaky) as rt:
        await setup_entries(rt, old)
        await new_task(rt, "T1")
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})  # clear done, fan-out open
        await register(
            rt, entries_yaml(new), import_path=True
        )  # the template is re-registered with another reason: a new version, T1 stays on its own

    logs: list[dict[str, Any]] = []
    async with restart(db_path, logs) as rt:
        store = rt.services.store
        assert await store.transact(lambda conn: states(conn, KEY)) == [
            (0, "clear_decisions", "done"),
            (1, "queue_run_for_each_participant", "done"),
        ]
        assert await store.transact(lambda conn: is_terminal(conn, KEY))
        assert await store.transact(keyed_runs) == full(reasons=("old",))
    assert loud_logs(logs) == []


# --- AC-B9 (e), (f) -------------------------------------------------------------------------------

WITHOUT_REVIEW = """\
id: entries
name: Entries
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
  - id: done
    name: Done
    position: 2
"""


def warnings_naming(logs: list[dict[str, Any]], task_id: str, step_id: str) -> list[dict[str, Any]]:
    return [r for r in logged(logs, "warning") if (r.get("task_id"), r.get("step_id")) == (task_id, step_id)]


async def test_ac_b9_e_an_entry_whose_step_was_deleted_is_closed_unresolvable_with_a_warning(
    db_path: Path,
) -> None:
    await prepare(db_path)

    def step_synced_away(conn: sqlite3.Connection) -> None:
        key = admit(conn, "T1", "review", THREE_KINDS)
        mark(conn, key, 1, "queue_run_for_each_participant", "in_progress")
        save_yaml(conn, WF, WITHOUT_REVIEW)

    await on_disk(db_path, step_synced_away)
    logs: list[dict[str, Any]] = []
    async with restart(db_path, logs) as rt:
        store = rt.services.store
        assert await store.transact(lambda conn: is_terminal(conn, KEY))
        assert await store.transact(run_rows) == []
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == []
    assert len(warnings_naming(logs, "T1", "review")) == 1

    again: list[dict[str, Any]] = []
    async with restart(db_path, again):
        pass
    assert warnings_naming(again, "T1", "review") == []  # not re-selected on the next start


async def test_ac_b9_e_an_orphaned_entry_whose_task_is_gone_is_closed_and_startup_completes(
    db_path: Path,
) -> None:
    await prepare(db_path)
    await on_disk(db_path, lambda conn: admit(conn, "T1", "review", THREE_KINDS))
    # A database where foreign keys were off when the task was deleted: the cascade did not fire.
    raw = sqlite3.connect(db_path)
    raw.execute("DELETE FROM tasks WHERE id = 'T1'")
    raw.commit()
    raw.close()

    logs: list[dict[str, Any]] = []
    async with restart(db_path, logs) as rt:
        assert await rt.services.store.transact(step_entries.open_entries) == []
        assert await rt.services.store.transact(run_rows) == []
        await ok(rt, {"type": "list_runs"})  # serving
    assert len(warnings_naming(logs, "T1", "review")) == 1


async def test_ac_b9_f_a_record_failing_transiently_is_left_open_with_an_error_and_the_rest_proceed(
    db_path: Path,
) -> None:
    await prepare(db_path, task_ids=("T1", "T2"))
    for task_id in ("T1", "T2"):
        await on_disk(db_path, lambda conn, t=task_id: admit(conn, t, "review", THREE_KINDS))
    flaky = raising("queue_run_for_each_participant", when=lambda ctx: ctx.task.id == "T1")

    logs: list[dict[str, Any]] = []
    async with restart(db_path, logs, executors=executors_with(queue_run_for_each_participant=flaky)) as rt:
        store = rt.services.store
        assert not await store.transact(lambda conn: is_terminal(conn, KEY))
        assert await store.transact(lambda conn: is_terminal(conn, EntryKey("T2", "review", 1)))
        assert await store.transact(lambda conn: keyed_runs(conn, "T2")) == full()
        assert await store.transact(keyed_runs) == []
    assert [r["task_id"] for r in logged(logs, "error")] and {
        r["task_id"] for r in logged(logs, "error")
    } == {"T1"}

    async with restart(db_path) as rt:  # a later start retries it
        store = rt.services.store
        assert await store.transact(lambda conn: is_terminal(conn, KEY))
        assert await store.transact(keyed_runs) == full()


CONTENDED = (
    "CREATE TRIGGER contended BEFORE UPDATE OF terminal ON step_entries WHEN NEW.task_id = 'T1'"
    " BEGIN SELECT RAISE(ABORT, 'database is locked'); END"
)


async def test_ac_b9_f_a_record_whose_own_write_fails_is_left_open_and_the_scan_goes_on(
    db_path: Path,
) -> None:
    await prepare(db_path, task_ids=("T1", "T2"))
    for task_id in ("T1", "T2"):
        await on_disk(db_path, lambda conn, t=task_id: admit(conn, t, "review", THREE_KINDS))
    await on_disk(db_path, lambda conn: conn.execute(CONTENDED))  # T1's entry row cannot be written

    logs: list[dict[str, Any]] = []
    async with restart(db_path, logs) as rt:
        store = rt.services.store
        assert not await store.transact(lambda conn: is_terminal(conn, KEY))
        assert await store.transact(lambda conn: is_terminal(conn, EntryKey("T2", "review", 1)))
        assert await store.transact(lambda conn: keyed_runs(conn, "T2")) == full()
        t1_runs = await store.transact(keyed_runs)
    assert {r["task_id"] for r in logged(logs, "error")} == {"T1"}

    await on_disk(db_path, lambda conn: conn.execute("DROP TRIGGER contended"))
    async with restart(db_path) as rt:  # a later start finishes it without executing anything twice
        store = rt.services.store
        assert await store.transact(lambda conn: is_terminal(conn, KEY))
        assert await store.transact(keyed_runs) == t1_runs == full()


def break_the_scan_query(conn: sqlite3.Connection) -> None:
    """Replace step_entries by a view whose SELECT fails at run time (an unknown SQL function)."""
    conn.execute("ALTER TABLE step_entries RENAME TO step_entries_real")
    conn.execute(
        "CREATE VIEW step_entries AS SELECT task_id, step_id, entry_seq, workflow_id, declaration_digest,"
        " entry_path, terminal, created_at, onceflow_no_such_function(terminal) AS broken"
        " FROM step_entries_real"
    )


def repair_the_scan_query(conn: sqlite3.Connection) -> None:
    conn.execute("DROP VIEW step_entries")
    conn.execute("ALTER TABLE step_entries_real RENAME TO step_entries")


async def test_ac_b9_f_the_scan_query_failing_is_logged_and_startup_still_completes(db_path: Path) -> None:
    await prepare(db_path)
    await on_disk(db_path, lambda conn: admit(conn, "T1", "review", THREE_KINDS))
    await on_disk(db_path, break_the_scan_query)

    logs: list[dict[str, Any]] = []
    async with restart(db_path, logs) as rt:
        reply = await ok(rt, {"type": "get_task", "task_id": "T1"})  # the runtime serves
        assert reply.result["step_id"] == "review"
        assert await rt.services.store.transact(run_rows) == []
        await rt.services.store.transact(repair_the_scan_query)
    assert logged(logs, "error")

    async with restart(db_path) as rt:  # entries resume on a later start
        assert await rt.services.store.transact(keyed_runs) == full()


CORRUPTIONS = {  # what a damaged row holds -> what the error names
    "a step id that is not UTF-8": (
        "UPDATE step_entries SET step_id = CAST(X'72657669ff' AS TEXT) WHERE task_id = 'T2'",
        "column step_id is not UTF-8 text",
    ),
    "a workflow id that is not UTF-8": (
        "UPDATE step_entries SET workflow_id = X'ff' WHERE task_id = 'T2'",
        "column workflow_id is not UTF-8 text",
    ),
    "an entry_seq stored as a real number": (
        "UPDATE step_entries SET entry_seq = 1.5 WHERE task_id = 'T2'",
        "column entry_seq holds 1.5, not an integer",
    ),
    "an entry_seq that is not an integer": (
        "UPDATE step_entries SET entry_seq = 'one' WHERE task_id = 'T2'",
        "column entry_seq holds b'one', not an integer",
    ),
}


@pytest.mark.parametrize(("corruption", "cause"), CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
async def test_ac_b9_f_an_entry_that_cannot_be_decoded_is_logged_and_the_other_entries_resume(
    db_path: Path, corruption: str, cause: str
) -> None:
    await prepare(db_path, task_ids=("T1", "T2", "T3"))
    for task_id in ("T1", "T2", "T3"):
        await on_disk(db_path, lambda conn, t=task_id: admit(conn, t, "review", THREE_KINDS))
    await on_disk(db_path, lambda conn: conn.execute(corruption))

    for _ in range(2):  # at every start: the others resume (then stay done), the bad row is reported again
        logs: list[dict[str, Any]] = []
        async with restart(db_path, logs) as rt:
            store = rt.services.store
            for task_id in ("T1", "T3"):
                assert await store.transact(
                    lambda conn, t=task_id: is_terminal(conn, EntryKey(t, "review", 1))
                )
                assert await store.transact(lambda conn, t=task_id: keyed_runs(conn, t)) == full()
            assert await store.transact(lambda conn: keyed_runs(conn, "T2")) == []
            await ok(rt, {"type": "list_runs"})  # serving
        (error,) = logged(logs, "error")
        assert error["event"] == "recovery_entry_undecodable"
        assert error["task_id"] == "T2" and isinstance(error["rowid"], int)
        assert {"step_id", "entry_seq"} <= error.keys()
        assert error["cause"].startswith(cause)


# --- the task-delete cascade ----------------------------------------------------------------------


async def test_deleting_a_task_removes_its_open_entry_and_the_next_scan_does_not_see_it(
    db_path: Path,
) -> None:
    flaky = executors_with(queue_run_for_each_participant=raising("queue_run_for_each_participant"))
    async with open_runtime(db_path, executors=flaky) as rt:
        await setup_entries(rt, THREE)
        await new_task(rt, "T1")
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
        store = rt.services.store
        assert await store.transact(lambda conn: states(conn, KEY)) == [(0, "clear_decisions", "done")]
        assert not await store.transact(lambda conn: is_terminal(conn, KEY))
        await ok(rt, {"type": "delete_task", "task_id": "T1"})

        def leftovers(conn: sqlite3.Connection) -> tuple[int, int]:
            entries = conn.execute("SELECT COUNT(*) FROM step_entries WHERE task_id = 'T1'").fetchone()[0]
            marks = conn.execute("SELECT COUNT(*) FROM step_entry_markers WHERE task_id = 'T1'").fetchone()[0]
            return entries, marks

        assert await store.transact(leftovers) == (0, 0)

    logs: list[dict[str, Any]] = []
    async with restart(db_path, logs) as rt:
        assert await rt.services.store.transact(step_entries.open_entries) == []
    assert [r for r in logs if r.get("task_id") == "T1"] == []


# --- AC-B6: the clear's marker and its delete share one transaction -------------------------------


def clear_then_fail() -> Executor:
    """The real clear, after which its transaction fails (as if at COMMIT)."""
    real = DEFAULT_EXECUTORS["clear_decisions"]

    def executor(conn: sqlite3.Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
        real(conn, ctx, action)
        raise sqlite3.OperationalError("disk I/O error")

    return executor


async def test_ac_b6_a_clear_whose_transaction_fails_leaves_delete_and_marker_undone_so_recovery_reruns_it(
    db_path: Path,
) -> None:
    async with open_runtime(db_path, executors=executors_with(clear_decisions=clear_then_fail())) as rt:
        await setup_entries(rt, THREE)
        await new_task(rt, "T1")
        store = rt.services.store
        stale = await store.transact(lambda conn: add_decision(conn, "T1", "review"))
        with capture_logs() as logs:
            await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == [stale]  # not deleted
        assert await store.transact(lambda conn: states(conn, KEY)) == []  # and not marked
        assert await store.transact(run_rows) == []  # the entry stopped at the clear
        assert [r["task_id"] for r in logged(logs, "error")] == ["T1"]

    async with restart(db_path) as rt:
        store = rt.services.store
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == []
        assert (await store.transact(lambda conn: states(conn, KEY)))[0] == (0, "clear_decisions", "done")
        assert await store.transact(keyed_runs) == full()


async def test_ac_b6_after_a_committed_clear_recovery_does_not_clear_again(db_path: Path) -> None:
    flaky = executors_with(queue_run_for_each_participant=raising("queue_run_for_each_participant"))
    async with open_runtime(db_path, executors=flaky) as rt:
        await setup_entries(rt, THREE)
        await new_task(rt, "T1")
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
        vote = await rt.services.store.transact(lambda conn: add_decision(conn, "T1", "review"))

    async with restart(db_path) as rt:
        store = rt.services.store
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == [vote]
        assert await store.transact(keyed_runs) == full()
        assert await store.transact(lambda conn: is_terminal(conn, KEY))


# --- AC-B8 and AC-A8: what recovery does and does not run again -----------------------------------


async def test_ac_b8_recovery_does_not_rerun_session_actions(db_path: Path) -> None:
    declaration = "- type: reset_agent_context\n" + CLEAR_AND_FAN_OUT + "- type: auto_start_agent\n"
    first_host, second_host = RecordingHost(), RecordingHost()
    flaky = executors_with(queue_run_for_each_participant=raising("queue_run_for_each_participant"))
    async with open_runtime(db_path, host=first_host, executors=flaky) as rt:
        await setup_entries(rt, declaration)
        await new_task(rt, "T1")
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
    assert [r.action for r in first_host.session_actions] == ["reset_agent_context", "auto_start_agent"]

    async with restart(db_path, host=second_host) as rt:
        store = rt.services.store
        assert await store.transact(keyed_runs) == full(reasons=("wake",))  # the entry was recovered
        assert await store.transact(lambda conn: is_terminal(conn, KEY))
    assert second_host.session_actions == []


async def test_ac_a8_run_code_review_claimed_by_a_dead_runtime_runs_again_on_recovery(db_path: Path) -> None:
    declaration = "- type: run_code_review\n" + CLEAR_AND_FAN_OUT
    await prepare(db_path, declaration)
    kinds = kinds_of(entries_yaml(declaration), "review")

    def launched_then_crashed(conn: sqlite3.Connection) -> None:
        mark(conn, admit(conn, "T1", "review", kinds), 0, "run_code_review", "in_progress")

    await on_disk(db_path, launched_then_crashed)
    host = RecordingHost()
    async with restart(db_path, host=host) as rt:
        marks = await rt.services.store.transact(lambda conn: states(conn, KEY))
        assert marks[0] == (0, "run_code_review", "done")
    assert [(t, s, seq, agent) for t, s, seq, _, agent in host.code_reviews] == [("T1", "review", 1, None)]
