"""Per-action claims: concurrent dispatches of one entry, the stop rule, distinct entries, read-once.

on-enter-action-dispatch.md: "Claim — per action", "A dispatcher that loses a claim stops", "Epoch",
AC-F1 and the declaration read-once line of Verification. Dispatchers are built from committed state
(entry_support.dispatcher) and run concurrently in one runtime, as two deliveries of one entry would be.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import trio
from entry_support import (
    CLEAR_AND_FAN_OUT,
    REVIEWERS,
    BlockingHost,
    add_decision,
    admit,
    decision_ids,
    dispatcher,
    entries_yaml,
    is_terminal,
    key_entry_seq,
    kinds_of,
    logged,
    loud,
    mark,
    new_task,
    run_rows,
    setup_entries,
    states,
)
from helpers import of_type, ok, register
from structlog.testing import capture_logs

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Event
from onceflow.store.entries import step_entries
from onceflow.store.entries.step_entries import EntryKey
from onceflow.testing import RecordingHost

FOUR = """
- type: clear_decisions
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: r1}
- type: run_code_review
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: r2}
"""


async def admitted(rt: Runtime, task_id: str, declaration: str) -> EntryKey:
    """Commit the task's admission to review (record included) without dispatching its on_enter."""
    kinds = kinds_of(entries_yaml(declaration), "review")
    return await rt.services.store.transact(lambda conn: admit(conn, task_id, "review", kinds))


async def run_together(*dispatches: Any) -> None:
    async with trio.open_nursery() as nursery:
        for dispatch in dispatches:
            nursery.start_soon(dispatch.run)


async def test_ac_f1_two_concurrent_dispatches_of_one_entry_execute_each_action_once_and_the_loser_is_silent(
    runtime: Runtime, host: RecordingHost
) -> None:
    await setup_entries(runtime, FOUR)
    task_ids = [f"T{i}" for i in range(6)]
    pairs: list[tuple[EntryKey, list[Event], list[Event]]] = []
    dispatches = []
    for task_id in task_ids:
        await new_task(runtime, task_id)
        await runtime.services.store.transact(lambda conn, t=task_id: add_decision(conn, t, "review"))
        key = await admitted(runtime, task_id, FOUR)
        first, first_events = await dispatcher(runtime, key, "E2")
        second, second_events = await dispatcher(runtime, key, "E2")
        dispatches += [first, second]
        pairs.append((key, first_events, second_events))

    with capture_logs() as logs:
        await run_together(*dispatches)

    assert logged(logs, "warning") == [] and logged(logs, "error") == []
    for key, first_events, second_events in pairs:
        both = first_events + second_events
        assert loud(both) == []
        assert len(of_type(both, "decisions_cleared")) == 1
        assert sorted((o.position, o.outcome) for o in of_type(both, "action_outcome")) == [
            (0, "done"),
            (1, "done"),
            (2, "done"),
            (3, "done"),
        ]
        assert of_type(both, "run_suppressed") == []  # the loser did not execute a fan-out either
        assert len(of_type(both, "run_queued")) == 4
        assert await runtime.services.store.transact(lambda conn, k=key: is_terminal(conn, k))
    assert sorted(review[0] for review in host.code_reviews) == task_ids  # one review pass per entry
    assert len(await runtime.services.store.transact(run_rows)) == 4 * len(task_ids)


async def test_ac_f1_stop_rule_a_loser_behind_a_live_external_claim_does_not_skip_ahead(
    tmp_path: Path,
) -> None:
    host = BlockingHost()
    declaration = "- type: run_code_review\n" + CLEAR_AND_FAN_OUT
    async with open_runtime(tmp_path / "db.sqlite", host=host) as rt:
        await setup_entries(rt, declaration)
        await new_task(rt, "T1")
        key = await admitted(rt, "T1", declaration)
        winner, winner_events = await dispatcher(rt, key, "E2")
        loser, loser_events = await dispatcher(rt, key, "E2")
        store = rt.services.store

        async with trio.open_nursery() as nursery:
            nursery.start_soon(winner.run)
            await host.entered.wait()  # the winner holds position 0 and is mid-effect
            with capture_logs() as logs, trio.fail_after(5):
                await loser.run()  # returns while the winner is still blocked
            assert await store.transact(run_rows) == []  # nothing declared after the held claim ran
            assert loser_events == [] and logs == []
            marks = await store.transact(lambda conn: step_entries.markers(conn, key))
            assert [(m.position, m.state, m.epoch) for m in marks.values()] == [(0, "in_progress", rt.epoch)]
            host.release.set()

        assert [r[1] for r in await store.transact(run_rows)] == list(REVIEWERS)  # the winner ran them
        assert await store.transact(lambda conn: is_terminal(conn, key))
        assert len(host.code_reviews) == 1
        assert len(of_type(winner_events, "action_outcome")) == 3


async def test_ac_f1_stop_rule_a_loser_behind_a_live_clear_claim_enqueues_nothing_and_recovery_finishes(
    db_path: Path,
) -> None:
    key = EntryKey("T1", "review", 1)
    async with open_runtime(db_path) as rt:
        await setup_entries(rt, CLEAR_AND_FAN_OUT)
        await new_task(rt, "T1")
        store = rt.services.store
        stale = await store.transact(lambda conn: add_decision(conn, "T1", "review"))
        assert await admitted(rt, "T1", CLEAR_AND_FAN_OUT) == key
        # Dispatcher A of this runtime holds the clear_decisions claim, its delete not yet committed.
        await store.transact(
            lambda conn: mark(conn, key, 0, "clear_decisions", "in_progress", epoch=rt.epoch)
        )

        loser, loser_events = await dispatcher(rt, key, "E2")
        with capture_logs() as logs:
            await loser.run()

        assert await store.transact(run_rows) == []  # no fan-out before A's delete commits
        assert loser_events == [] and logs == []
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == [stale]
        assert await store.transact(lambda conn: states(conn, key)) == [(0, "clear_decisions", "in_progress")]
        assert not await store.transact(lambda conn: is_terminal(conn, key))

    # A dies with the runtime; its claim is now stale by epoch and the next start finishes the entry in order.
    async with open_runtime(db_path) as rt:
        store = rt.services.store
        assert await store.transact(lambda conn: decision_ids(conn, "T1", "review")) == []
        assert sorted(r[1] for r in await store.transact(run_rows)) == list(REVIEWERS)
        assert await store.transact(lambda conn: is_terminal(conn, key))


async def test_ac_f1_two_distinct_entries_of_one_task_and_step_both_execute_in_full(runtime: Runtime) -> None:
    await setup_entries(runtime, CLEAR_AND_FAN_OUT)
    await new_task(runtime, "T1")
    kinds = kinds_of(entries_yaml(CLEAR_AND_FAN_OUT), "review")

    def two_entries(conn: sqlite3.Connection) -> tuple[EntryKey, EntryKey]:
        first = admit(conn, "T1", "review", kinds)
        admit(conn, "T1", "work", [])  # left (work declares nothing) ...
        return first, admit(conn, "T1", "review", kinds)  # ... and came back

    first, second = await runtime.services.store.transact(two_entries)
    assert (first.entry_seq, second.entry_seq) == (1, 2)
    one, one_events = await dispatcher(runtime, first, "E2")
    two, two_events = await dispatcher(runtime, second, "E2")
    await run_together(one, two)

    for key, emitted in ((first, one_events), (second, two_events)):
        assert [(o.position, o.outcome) for o in of_type(emitted, "action_outcome")] == [
            (0, "done"),
            (1, "done"),
        ]
        assert len(of_type(emitted, "decisions_cleared")) == 1
        assert await runtime.services.store.transact(lambda conn, k=key: is_terminal(conn, k))
    runs = await runtime.services.store.transact(run_rows)
    assert sorted((key_entry_seq(k), agent) for _, agent, _, k in runs) == [
        (seq, agent) for seq in (1, 2) for agent in REVIEWERS
    ]


async def test_declaration_read_once_a_dispatch_finishes_against_the_declaration_it_started_with(
    tmp_path: Path,
) -> None:
    host = BlockingHost()
    before = """
- type: run_code_review
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: before-1}
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: before-2}
"""
    after = before.replace("before-", "after-")
    async with open_runtime(tmp_path / "db.sqlite", host=host) as rt:
        await setup_entries(rt, before)
        await new_task(rt, "T1")
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ok, rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
                await host.entered.wait()  # T1's dispatch is between positions 0 and 1
                await register(rt, entries_yaml(after), import_path=True)  # a sync lands mid-dispatch
                host.release.set()
        await new_task(rt, "T2")  # created on the new version (T1 stays pinned to the old one)
        await ok(rt, {"type": "move_task", "task_id": "T2", "step_id": "review"})

        reasons = {(task, reason) for task, _, reason, _ in await rt.services.store.transact(run_rows)}
    assert reasons == {("T1", "before-1"), ("T1", "before-2"), ("T2", "after-1"), ("T2", "after-2")}
