"""Step-entry records: allocation on every entry path, identity and keys, replay, participants and decisions.

on-enter-action-dispatch.md: Execution model ("The step-entry record", "Who allocates it"), AC-B1 … AC-B7,
AC-E5, AC-F2, AC-F3 and their Verification lines. E3 (WIP promotion) is covered by test_wip_entries.py.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from entry_support import (
    CLEAR_AND_FAN_OUT,
    OTHER,
    REVIEWERS,
    WF,
    add_decision,
    decision_ids,
    dispatcher,
    entries_yaml,
    executors_with,
    key_entry_seq,
    key_position,
    kinds_of,
    logged,
    loud,
    markers_as_rows,
    new_task,
    other_yaml,
    setup_entries,
    states,
)
from helpers import FakeClock, add_participant, events, list_entries, list_runs, of_type, ok, register, send
from structlog.testing import capture_logs

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.entries import step_entries
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, ActionContext, Effect
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.tasks import tasks
from onceflow.testing import RecordingHost

# Every step a path test enters declares this: session actions around two engine-owned ones.
TARGET = """
- type: set_session_mode
  config: {mode: entered}
- type: clear_decisions
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: wake}
- type: auto_start_agent
"""
# The E4 landing step declares one more engine action, so its digest differs from the other steps'.
INTAKE = (
    TARGET
    + """
- type: ensure_participant_seat
  config: {role: reviewer}
"""
)


@attrs.frozen
class EntrySite:
    """One entry site driven through its real command: from `source` (a step of `entries`) to `target`."""

    name: str
    source: str
    command: Callable[[str], dict[str, Any]]
    target: tuple[str, str]
    entry_path: str


PATHS = [
    EntrySite(
        "turn_complete", "work", lambda t: {"type": "turn_complete", "task_id": t}, (WF, "review"), "E1"
    ),
    EntrySite(
        "record_decision",
        "review",
        lambda t: {
            "type": "record_decision",
            "task_id": t,
            "step_id": "review",
            "decider_type": "agent",
            "decider_id": "rev-a",
            "role": "reviewer",
            "decision": "rejected",
        },
        (WF, "work"),
        "E1",
    ),
    EntrySite(
        "move_task",
        "work",
        lambda t: {"type": "move_task", "task_id": t, "step_id": "review"},
        (WF, "review"),
        "E2",
    ),
    EntrySite(
        "switch_workflow",
        "work",
        lambda t: {"type": "switch_workflow", "task_id": t, "workflow_id": OTHER},
        (OTHER, "intake"),
        "E4",
    ),
    EntrySite(
        "update_task",
        "work",
        lambda t: {"type": "update_task", "task_id": t, "step_id": "review"},
        (WF, "review"),
        "E5",
    ),
    EntrySite(
        "start_task",
        "work",
        lambda t: {"type": "start_task", "task_id": t, "step_id": "review"},
        (WF, "review"),
        "E5",
    ),
]
PATH_IDS = [p.name for p in PATHS]


async def setup_paths(rt: Runtime, declaration: str = TARGET, intake: str = INTAKE) -> None:
    """`entries` with `declaration` at work and review, `other` with `intake`; reviewers at all three."""
    await setup_entries(rt, declaration, work=declaration, seat_at=("work", "review"))
    await register(rt, other_yaml(intake), import_path=True)
    for reviewer in REVIEWERS:
        await add_participant(rt, OTHER, "intake", "reviewer", reviewer)


async def where(rt: Runtime, task_id: str) -> tuple[str, str]:
    reply = await ok(rt, {"type": "get_task", "task_id": task_id})
    return reply.result["workflow_id"], reply.result["step_id"]


def entered_actions(host: RecordingHost, step_id: str) -> list[str]:
    return [request.action for request in host.session_actions if request.step_id == step_id]


# --- AC-B7: allocation on every entry path --------------------------------------------------------


@pytest.mark.parametrize("case", PATHS, ids=PATH_IDS)
async def test_ac_b7_every_entry_path_allocates_a_record_with_the_landing_steps_digest(
    runtime: Runtime, case: EntrySite
) -> None:
    await setup_paths(runtime)
    await new_task(runtime, "T1", case.source)
    reply = await ok(runtime, case.command("T1"))

    workflow_id, step_id = case.target
    assert await where(runtime, "T1") == case.target
    [entry] = await list_entries(runtime, "T1")
    yaml_text = other_yaml(INTAKE) if workflow_id == OTHER else entries_yaml(TARGET, TARGET)
    kinds = kinds_of(yaml_text, step_id)
    assert (entry["step_id"], entry["entry_seq"], entry["entry_path"], entry["workflow_id"]) == (
        step_id,
        1,
        case.entry_path,
        workflow_id,
    )
    assert entry["declaration_digest"] == step_entries.declaration_digest(kinds)
    assert entry["terminal"] is True
    assert {(m["kind"], m["state"]) for m in entry["markers"]} >= {
        ("clear_decisions", "done"),
        ("queue_run_for_each_participant", "done"),
    }
    assert [(e.step_id, e.entry_seq, e.entry_path) for e in events(reply, "step_entered")] == [
        (step_id, 1, case.entry_path)
    ]
    runs = await list_runs(runtime, task_id="T1")
    assert sorted(r["agent_profile_id"] for r in runs) == list(REVIEWERS)
    assert {(r["step_id"], key_entry_seq(r["idempotency_key"])) for r in runs} == {(step_id, 1)}


NOT_ENTRIES = {
    "create_into_the_step": ("review", None),
    "move_to_the_current_step": ("review", {"type": "move_task", "step_id": "review"}),
    "update_task_to_the_current_step": ("review", {"type": "update_task", "step_id": "review", "title": "x"}),
    "start_task_at_the_current_step": ("review", {"type": "start_task", "step_id": "review"}),
    "switch_workflow_to_the_current_step": (
        "review",
        {"type": "switch_workflow", "workflow_id": WF, "step_id": "review"},
    ),
}


@pytest.mark.parametrize("name", list(NOT_ENTRIES))
async def test_ac_b7_negatives_creation_and_a_move_to_the_current_step_allocate_nothing(
    runtime: Runtime, host: RecordingHost, name: str
) -> None:
    await setup_paths(runtime)
    source, message = NOT_ENTRIES[name]
    await new_task(runtime, "T1", source)
    replies = [] if message is None else [await ok(runtime, {**message, "task_id": "T1"})]

    assert await where(runtime, "T1") == (WF, "review")
    assert await list_entries(runtime, "T1") == []
    assert await list_runs(runtime) == []
    assert host.session_actions == []  # nothing of on_enter ran either
    assert [events(reply, "step_entered") for reply in replies] == [[] for _ in replies]


@pytest.mark.parametrize(
    "declaration", ["[]", "- type: auto_start_agent"], ids=["empty", "orchestrator_only"]
)
@pytest.mark.parametrize("case", PATHS, ids=PATH_IDS)
async def test_ac_e5_no_engine_owned_action_means_no_record_on_every_path(
    runtime: Runtime, host: RecordingHost, case: EntrySite, declaration: str
) -> None:
    await setup_paths(runtime, declaration, declaration)
    await new_task(runtime, "T1", case.source)
    reply = await ok(runtime, case.command("T1"))

    step_id = case.target[1]
    assert await where(runtime, "T1") == case.target
    assert await list_entries(runtime, "T1") == []
    assert [(e.step_id, e.entry_seq) for e in events(reply, "step_entered")] == [(step_id, None)]
    expected = [] if declaration == "[]" else ["auto_start_agent"]
    assert entered_actions(host, step_id) == expected  # the session path is unchanged


# --- AC-B7: a failed allocation fails the transition as a unit ------------------------------------

NO_ENTRIES = "CREATE TRIGGER no_entries BEFORE INSERT ON step_entries BEGIN SELECT RAISE(ABORT, 'no'); END"


@pytest.mark.parametrize("case", PATHS, ids=PATH_IDS)
async def test_ac_b7_allocation_failure_leaves_the_step_unchanged_runs_nothing_and_logs_an_error(
    runtime: Runtime, host: RecordingHost, case: EntrySite
) -> None:
    await setup_paths(runtime)
    await new_task(runtime, "T1", case.source)
    step_id = case.target[1]
    stale = await runtime.services.store.transact(lambda conn: add_decision(conn, "T1", step_id))
    await runtime.services.store.transact(lambda conn: conn.execute(NO_ENTRIES))

    with capture_logs() as logs:
        reply = await send(runtime, case.command("T1"))

    assert not reply.ok and reply.error is not None and reply.error.code == "transition_failed"
    assert await where(runtime, "T1") == (WF, case.source)
    assert await list_entries(runtime, "T1") == []
    assert await list_runs(runtime) == []
    assert entered_actions(host, step_id) == []
    assert stale in await runtime.services.store.transact(lambda conn: decision_ids(conn, "T1", step_id))
    [error] = logged(logs, "error", "step_admission_failed")  # and no actor crash on top of it
    assert (error["task_id"], error["step_id"]) == ("T1", step_id)

    # The entry is recoverable by a later replay once allocation works again.
    await runtime.services.store.transact(lambda conn: conn.execute("DROP TRIGGER no_entries"))
    await ok(runtime, case.command("T1"))
    assert await where(runtime, "T1") == case.target
    assert [(e["step_id"], e["entry_seq"]) for e in await list_entries(runtime, "T1")] == [(step_id, 1)]


class _StaleMaxRead:
    """A connection whose allocator read of MAX(entry_seq) happened before a rival allocator committed."""

    def __init__(self, conn: sqlite3.Connection, successor: int) -> None:
        self._conn, self._successor = conn, successor

    def execute(self, sql: str, params: Any = ()) -> Any:
        if "step_entries" in sql and "MAX(entry_seq)" in sql:
            return self._conn.execute("SELECT ?", (self._successor,))
        return self._conn.execute(sql, params)


async def test_ac_b7_two_allocators_racing_one_pair_cannot_both_commit_the_same_entry_seq(
    runtime: Runtime,
) -> None:
    await setup_entries(runtime, CLEAR_AND_FAN_OUT)
    await new_task(runtime, "T1")
    digest = step_entries.declaration_digest(["clear_decisions", "queue_run_for_each_participant"])

    def allocate(conn: Any) -> EntryKey:
        return step_entries.allocate_entry(
            conn, task_id="T1", step_id="review", workflow_id=WF, digest=digest, entry_path="E2", now=0.0
        )

    def losing_transition(conn: sqlite3.Connection) -> EntryKey:
        assert tasks.move_task_step(
            conn, task_id="T1", expected_step_id="work", workflow_id=WF, step_id="review", now=0.0
        )
        return allocate(_StaleMaxRead(conn, successor=1))  # both read MAX = none, both want 1

    winner = await runtime.services.store.transact(allocate)
    assert winner.entry_seq == 1
    with pytest.raises(sqlite3.IntegrityError):
        await runtime.services.store.transact(losing_transition)

    assert await where(runtime, "T1") == (WF, "work")  # the loser's step change rolled back with it
    assert [e["entry_seq"] for e in await list_entries(runtime, "T1")] == [1]


# --- AC-B1, AC-B3: identity and keys --------------------------------------------------------------


async def test_ac_b3_ac_b1_every_reentry_is_a_new_entry_with_fresh_keys(runtime: Runtime) -> None:
    await setup_entries(
        runtime,
        CLEAR_AND_FAN_OUT
        + """
- type: queue_run
  config: {target: "agent_profile_id:ceo", reason: kick}
""",
    )
    await new_task(runtime, "T1")
    await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "review"})  # E2
    await runtime.services.store.transact(lambda conn: add_decision(conn, "T1", "review"))
    await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "work"})
    again = await ok(runtime, {"type": "update_task", "task_id": "T1", "step_id": "review"})  # E5

    assert [(e["entry_seq"], e["entry_path"]) for e in await list_entries(runtime, "T1")] == [
        (1, "E2"),
        (2, "E5"),
    ]
    assert [e.deleted for e in events(again, "decisions_cleared")] == [1]  # a fresh clear for the new entry
    assert events(again, "run_suppressed") == [] and events(again, "run_coalesced") == []
    runs = await list_runs(runtime, task_id="T1")
    keys = [r["idempotency_key"] for r in runs]
    assert len(set(keys)) == len(keys) == 6
    assert sorted(
        (key_entry_seq(k), key_position(k), r["agent_profile_id"]) for k, r in zip(keys, runs, strict=True)
    ) == [
        (seq, position, agent)
        for seq in (1, 2)
        for position, agent in ((1, "rev-a"), (1, "rev-b"), (2, "ceo"))
    ]
    assert all(r["exclude_from_coalescing"] for r in runs)


async def test_ac_h5_the_same_fan_out_declared_twice_is_not_an_idempotency_suppression(
    runtime: Runtime,
) -> None:
    fan_out = """
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: twice}
"""
    await setup_entries(runtime, fan_out + fan_out, reviewers=("rev-a",))
    await new_task(runtime, "T1")
    reply = await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "review"})

    assert events(reply, "run_suppressed") == []
    finished = [d.fields for d in events(reply, "diagnostic") if d.code == "fan_out_finished"]
    assert [(f["enqueued"], f["suppressed"]) for f in finished] == [(1, 0), (1, 0)]
    runs = await list_runs(runtime, agent_profile_id="rev-a")
    assert sorted(key_position(r["idempotency_key"]) for r in runs) == [0, 1]


async def test_ac_b4_a_replayed_fan_out_hits_its_own_keys_counts_them_as_success_and_does_not_retry(
    runtime: Runtime,
) -> None:
    await setup_entries(runtime, CLEAR_AND_FAN_OUT)
    await new_task(runtime, "T1")
    await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "review"})
    key = EntryKey("T1", "review", 1)

    def fan_out_marker_lost(conn: sqlite3.Connection) -> None:
        # The fan-out's runs committed but its completion did not (AC-B6 lets the fan-out mark separately).
        markers_as_rows(conn, "T1")
        conn.execute(
            "UPDATE step_entry_markers SET state = 'in_progress', epoch = 'old-epoch' WHERE task_id = 'T1'"
            " AND position = 1"
        )
        conn.execute("UPDATE step_entries SET terminal = 0 WHERE task_id = 'T1'")

    await runtime.services.store.transact(fan_out_marker_lost)
    dispatch, emitted = await dispatcher(runtime, key)
    with capture_logs() as logs:
        await dispatch.run()

    assert of_type(emitted, "run_queued") == []
    assert sorted(e.agent_profile_id for e in of_type(emitted, "run_suppressed")) == list(
        REVIEWERS
    )  # once each
    assert [(o.position, o.outcome) for o in of_type(emitted, "action_outcome")] == [(1, "done")]
    [finished] = [d.fields for d in of_type(emitted, "diagnostic") if d.code == "fan_out_finished"]
    assert (finished["matching"], finished["enqueued"], finished["suppressed"]) == (2, 2, 2)
    assert loud(emitted) == [] and logged(logs, "error") == [] and logged(logs, "warning") == []
    assert len(await list_runs(runtime, task_id="T1")) == 2
    assert await runtime.services.store.transact(lambda conn: states(conn, key)) == [
        (0, "clear_decisions", "done"),
        (1, "queue_run_for_each_participant", "done"),
    ]


# --- AC-B2, AC-B5: the same entry dispatched twice ------------------------------------------------


async def test_ac_b2_ac_b5_the_same_entry_dispatched_again_in_process_and_after_a_restart_does_nothing(
    db_path: Path, clock: FakeClock
) -> None:
    key = EntryKey("T1", "review", 1)
    async with open_runtime(db_path, clock=clock) as rt:
        await setup_entries(rt, CLEAR_AND_FAN_OUT)
        await new_task(rt, "T1")
        first = await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
        assert [e.deleted for e in events(first, "decisions_cleared")] == [0]
        later = await rt.services.store.transact(lambda conn: add_decision(conn, "T1", "review"))

        replay, emitted = await dispatcher(rt, key, "E2")
        await replay.run()
        assert emitted == []  # no clear, no enqueue, not even a suppressed one
        assert len(await list_runs(rt)) == 2

    async with open_runtime(db_path, clock=clock) as rt:  # a fresh store: only the durable state is shared
        replay, emitted = await dispatcher(rt, key, "E2")
        await replay.run()
        assert emitted == []
        runs = await list_runs(rt)
        assert sorted(r["agent_profile_id"] for r in runs) == list(REVIEWERS)  # one run per participant
        assert await rt.services.store.transact(lambda conn: decision_ids(conn, "T1", "review")) == [later]


async def test_ac_b5_skipped_and_failed_markers_are_terminal_and_their_diagnostics_are_not_repeated(
    runtime: Runtime,
) -> None:
    await setup_entries(
        runtime,
        """
- type: queue_run_for_each_participant
  config: {reason: no_role}
- type: queue_run_for_each_participant
  config: {role: watcher, reason: watch}
""",
        reviewers=(),
    )
    await add_participant(runtime, WF, "review", "watcher", "")  # no agent profile: that participant fails
    await add_participant(runtime, WF, "review", "watcher", "watch-1")
    await new_task(runtime, "T1")
    first = await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "review"})
    key = EntryKey("T1", "review", 1)
    codes = {d.code for d in loud(first.events)}
    assert {"fan_out_participant_failed", "fan_out_role_missing"} <= codes
    assert await runtime.services.store.transact(lambda conn: states(conn, key)) == [
        (0, "queue_run_for_each_participant", "skipped"),
        (1, "queue_run_for_each_participant", "failed"),
    ]

    replay, emitted = await dispatcher(runtime, key, "E2")
    await replay.run()
    assert emitted == []
    assert [r["agent_profile_id"] for r in await list_runs(runtime)] == ["watch-1"]


# --- AC-F2, AC-F3: participants and decisions around the effect -----------------------------------


class _AddsAParticipantAfterTheRead:
    """Commits a new reviewer seat right after the fan-out's participant query has returned."""

    def __init__(self, conn: sqlite3.Connection, reads: list[str]) -> None:
        self._conn, self._reads = conn, reads

    def execute(self, sql: str, params: Any = ()) -> Any:
        if sql.lstrip().upper().startswith("SELECT") and "FROM participants" in sql:
            rows = self._conn.execute(sql, params).fetchall()
            self._reads.append(sql)
            if len(self._reads) == 1:
                self._conn.execute(
                    "INSERT INTO participants (workflow_id, step_id, task_id, role, agent_profile_id)"
                    " VALUES (?, 'review', NULL, 'reviewer', 'rev-late')",
                    (WF,),
                )
            return _Rows(rows)
        return self._conn.execute(sql, params)


@attrs.define
class _Rows:
    rows: list[Any]

    def fetchall(self) -> list[Any]:
        return list(self.rows)

    def fetchone(self) -> Any:
        return self.rows[0] if self.rows else None


async def test_ac_f2_the_fan_out_reads_the_participant_set_once_and_acts_on_that_read(
    runtime: Runtime,
) -> None:
    reads: list[str] = []
    real = DEFAULT_EXECUTORS["queue_run_for_each_participant"]

    def fan_out(conn: sqlite3.Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
        return real(_AddsAParticipantAfterTheRead(conn, reads), ctx, action)  # type: ignore[arg-type]

    runtime.reconfigure(executors=executors_with(queue_run_for_each_participant=fan_out))
    await setup_entries(runtime, CLEAR_AND_FAN_OUT)
    await new_task(runtime, "T1")
    await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "review"})

    assert len(reads) == 1  # one query for the whole fan-out
    assert sorted(r["agent_profile_id"] for r in await list_runs(runtime)) == list(REVIEWERS)  # not rev-late


async def test_ac_f3_a_decision_before_the_delete_is_deleted_and_one_after_it_survives(
    runtime: Runtime,
) -> None:
    await setup_entries(runtime, CLEAR_AND_FAN_OUT)
    await new_task(runtime, "T1")
    store = runtime.services.store
    before = await store.transact(lambda conn: add_decision(conn, "T1", "review"))
    entered = await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "review"})
    after = await store.transact(lambda conn: add_decision(conn, "T1", "review", "rev-b"))

    assert [e.deleted for e in events(entered, "decisions_cleared")] == [1]
    ids = await store.transact(lambda conn: decision_ids(conn, "T1", "review"))
    assert before not in ids and ids == [after]
    markers = await store.transact(lambda conn: states(conn, EntryKey("T1", "review", 1)))
    assert markers[0] == (0, "clear_decisions", "done")


async def test_ac_f3_decisions_recorded_concurrently_fall_on_exactly_one_side_of_the_delete(
    runtime: Runtime,
) -> None:
    at_delete: list[int] = []
    real = DEFAULT_EXECUTORS["clear_decisions"]

    def clear(conn: sqlite3.Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
        (newest,) = conn.execute("SELECT COALESCE(MAX(id), 0) FROM decisions").fetchone()
        at_delete.append(newest)  # every row up to here committed before the delete's transaction
        return real(conn, ctx, action)

    runtime.reconfigure(executors=executors_with(clear_decisions=clear))
    await setup_entries(runtime, CLEAR_AND_FAN_OUT)
    await new_task(runtime, "T1")
    store = runtime.services.store
    inserted = [await store.transact(lambda conn: add_decision(conn, "T1", "review")) for _ in range(3)]
    cleared: list[int] = []

    async def record_concurrently() -> None:
        for _ in range(20):
            inserted.append(await store.transact(lambda conn: add_decision(conn, "T1", "review")))
            await trio.sleep(0)

    async def enter() -> None:
        reply = await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "review"})
        cleared.extend(e.deleted for e in events(reply, "decisions_cleared"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(record_concurrently)
        nursery.start_soon(enter)
    inserted.append(await store.transact(lambda conn: add_decision(conn, "T1", "review")))

    [line] = at_delete
    remaining = await store.transact(lambda conn: decision_ids(conn, "T1", "review"))
    assert remaining == [i for i in inserted if i > line]  # everything after the delete survives
    assert cleared == [len([i for i in inserted if i <= line])]  # everything before it is gone
    assert cleared[0] >= 3 and remaining


async def test_ac_c1_ac_e2_a_partly_failed_fan_out_logs_one_error_per_failed_participant_and_nothing_else(
    runtime: Runtime,
) -> None:
    await setup_entries(runtime, CLEAR_AND_FAN_OUT)
    await add_participant(runtime, WF, "review", "reviewer", "")  # matches, but has no agent profile
    await new_task(runtime, "T1")
    with capture_logs() as logs:
        await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "review"})

    [finished] = logged(logs, "info", "fan_out_finished")
    assert (finished["matching"], finished["enqueued"]) == (3, 2)
    marks = await runtime.services.store.transact(
        lambda conn: step_entries.markers(conn, EntryKey("T1", "review", 1))
    )
    assert (marks[1].state, marks[1].detail.split(" first_cause=")[0]) == ("failed", "attempted=3 failed=1")
    assert [r["event"] for r in logged(logs, "error")] == ["fan_out_participant_failed"]
