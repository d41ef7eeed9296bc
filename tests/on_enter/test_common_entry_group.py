"""Common entries admitted together in one writer batch decide exactly what they decide one after another.

The writer runs the common entries of
one batch that share a plan, workflow and path (`common_entry.admit_group`) with one set of statements. Any
entry the common path cannot decide alone (moved or stale, a key taken or merged, a seat without an agent)
rolls the whole group back and each entry runs alone (`admit_common`, then the per-action path). Rules
compared: AC-A3, AC-A5, AC-B5, AC-B6, AC-C1, AC-H6, coalesced keys, the cached row's
compare-and-set.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import trio
import trio.testing
from entry_support import add_decision, snapshot, unfolded
from hand_clock import run_still
from helpers import FakeClock, ok, send
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from test_common_entry import ACTIONS, key_in_advance, seat_message, workflow_yaml

import onceflow.store.entries.admission as admission
from onceflow.actors.engine.common import common_order
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.entries.common_entry import Admission, admit_common, admit_group, common_plan
from onceflow.store.runs import keys, runs
from onceflow.store.tasks import tasks
from onceflow.store.writer import Grouped

TASKS = ("T0", "T1", "T2", "T3")
COMMON = [name for name in ACTIONS if name not in ("queue_run", "auto_start")]
SEATS = ["rev-a", "rev-b", "rev-a", "", "approver:app-1", "own:T0:rev-a", "own:T1:rev-c"]
BEFORE = ("fresh", "fresh", "fresh", "entered", "decided", "take_key", "merge_key", "moved", "stale_cache")

scenarios = st.fixed_dictionaries(
    {
        "review": st.lists(st.sampled_from(COMMON), min_size=1, max_size=4),
        "seats": st.lists(
            st.sampled_from(SEATS),
            max_size=4,
        ),
        "before": st.fixed_dictionaries({task: st.sampled_from(BEFORE) for task in TASKS}),
        "cached": st.fixed_dictionaries({task: st.booleans() for task in TASKS}),
        "order": st.permutations(TASKS).flatmap(lambda order: st.integers(2, 4).map(lambda n: order[:n])),
    }
)


async def prepare(rt: Runtime, scenario: dict[str, Any]) -> list[Admission]:
    """Register the review step, seat the participants, give each task its state before the admission and
    return the admissions in `scenario["order"]` (the same on every database: a FakeClock runtime)."""
    text = workflow_yaml(scenario["review"], 0)
    await ok(rt, {"type": "register_workflow", "yaml": text, "source": "t.yml", "import_path": True})
    for task_id in TASKS:
        await ok(rt, {"type": "create_task", "task_id": task_id, "workflow_id": "common"})
    for seat in scenario["seats"]:
        await ok(rt, seat_message(seat))
    review = rt.services.workflows.workflows["common"].step("review")
    store = rt.services.store
    for seq, (task_id, before) in enumerate(scenario["before"].items()):
        if before == "entered":  # an earlier entry: this admission is its second
            await send(rt, {"type": "move_task", "task_id": task_id, "step_id": "review"})
            await ok(rt, {"type": "move_task", "task_id": task_id, "step_id": "work"})
        elif before == "decided":
            await store.transact(lambda conn, t=task_id: add_decision(conn, t, "review"))
        elif before in ("take_key", "merge_key"):
            for request in key_in_advance(before, task_id, review, seq):
                await store.transact(lambda conn, r=request: runs.enqueue_run(conn, r, 1.0))
    order = common_order(rt.services.executors, review, "E1")
    assert order is not None
    plan = common_plan(review, order)
    admissions = []
    for task_id in scenario["order"]:
        task = await store.transact(lambda conn, t=task_id: tasks.get_task(conn, t))
        assert task is not None
        before = scenario["before"][task_id]
        cached = scenario["cached"][task_id]
        version = (task.workflow_id, task.wip_admitted, task.admissions) if cached else None
        if before == "stale_cache":  # a cached row one admission behind the committed one
            version = (task.workflow_id, task.wip_admitted, task.admissions - 1)
        if before == "moved":  # the task moved on after its row was read
            await store.transact(
                lambda conn, t=task_id: (
                    conn.execute("UPDATE tasks SET workflow_step_id = 'review' WHERE id = ?", (t,)).rowcount
                )
            )
        admissions.append(Admission(task, "common", plan, "E1", 100.0 + len(admissions), version))
    return admissions


def holding(release: threading.Event) -> tuple[Any, threading.Event]:
    """A request that keeps the writer busy until `release` is set, and an event set once the writer runs
    it: requests queued after that share the writer's next batch."""
    started = threading.Event()

    def hold(conn: sqlite3.Connection) -> bool:
        started.set()
        return release.wait(10)

    return hold, started


def alone(admission: Admission) -> Any:
    """One entry's own request, as `Engine.enter_step` makes it: the common path alone (its fallback, the
    per-action path, is compared by tests/on_enter/test_common_entry.py)."""

    def run(conn: sqlite3.Connection) -> Any:
        return admit_common(
            conn,
            task=admission.task,
            workflow_id=admission.workflow_id,
            plan=admission.plan,
            path=admission.path,
            now=admission.now,
            version=admission.version,
        )

    return run


async def one_batch(rt: Runtime, admissions: list[Admission]) -> tuple[list[Any], list[Any]]:
    """Queue every admission's request (grouped) behind a request that holds the writer, so that they share
    one batch; returns each request's result and what the group run returned (one entry per run)."""
    store = rt.services.store
    ran: list[Any] = []

    def group_run(conn: sqlite3.Connection, items: list[Admission]) -> Any:
        result = admit_group(conn, items)
        ran.append(result)
        return result

    release = threading.Event()
    results: list[Any] = [None] * len(admissions)
    async with trio.open_nursery() as nursery:
        hold, started = holding(release)
        nursery.start_soon(store.transact, hold)
        await trio.to_thread.run_sync(started.wait, 10)  # the writer is inside it: the rest queue behind

        async def admit(index: int, admission: Admission) -> None:
            group = Grouped((id(admission.plan), "common", "E1"), admission, group_run)
            results[index] = await store.transact_grouped(group, alone(admission))

        for index, admission in enumerate(admissions):
            nursery.start_soon(admit, index, admission)
            await trio.testing.wait_all_tasks_blocked()  # queued in order
        release.set()
    return results, ran


async def batched(db: Path, scenario: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    async with open_runtime(db, clock=FakeClock()) as rt:
        return await one_batch(rt, await prepare(rt, scenario))


async def one_by_one(db: Path, scenario: dict[str, Any]) -> list[Any]:
    async with open_runtime(db, clock=FakeClock()) as rt:
        return [await rt.services.store.transact(alone(a)) for a in await prepare(rt, scenario)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=scenarios)
def test_a_group_of_common_entries_decides_each_as_one_after_another(
    tmp_path_factory: Any, scenario: dict[str, Any]
) -> None:
    folder = tmp_path_factory.mktemp("group")
    together, ran = run_still(batched, folder / "together.db", scenario)
    separately = run_still(one_by_one, folder / "separately.db", scenario)
    assert snapshot(folder / "together.db") == snapshot(folder / "separately.db")
    assert together == separately  # keys, cleared counts, run ids and idempotency keys
    assert len(ran) == 1  # the writer ran the group once
    event("group decided" if ran[0] is not None else "group declined")
    assert (ran[0] is not None) == all(result is not None for result in separately)


def admitted_by_one_group_run(db: Path | str) -> None:
    """Entries with nothing in the way, batched on `db`: the group decides them, and its result is each
    one's (seqs, clears and run ids in entry order)."""
    scenario = {
        "review": ["clear", "fan_out", "fan_out_approver"],
        "seats": ["rev-a", "rev-b", "approver:app-1"],
        "before": dict.fromkeys(TASKS, "fresh") | {"T1": "decided", "T2": "entered"},
        "cached": dict.fromkeys(TASKS, True),
        "order": ("T2", "T0", "T1", "T3"),
    }
    together, ran = run_still(batched, db, scenario)
    assert ran[0] == together
    assert [entry.key.task_id for entry in together] == ["T2", "T0", "T1", "T3"]
    assert [entry.key.entry_seq for entry in together] == [2, 1, 1, 1]
    assert [entry.done[0] for entry in together] == [(0, 0), (0, 0), (0, 1), (0, 0)]  # T1's decision
    run_ids = [run_id for entry in together for _, did in entry.done[1:] for _, run_id, _ in did]  # type: ignore[union-attr]
    assert run_ids == sorted(run_ids) and len(run_ids) == 12  # in entry order, three seats each


def sent_back_one_at_a_time(db: Path | str) -> None:
    """T1's first key taken in advance, batched on `db`: the group is rolled back and each entry decided
    alone; T1 by the per-action path (suppressed), the others by the common path."""
    scenario = {
        "review": ["clear", "fan_out"],
        "seats": ["rev-a"],
        "before": dict.fromkeys(TASKS, "fresh") | {"T1": "take_key"},
        "cached": dict.fromkeys(TASKS, False),
        "order": TASKS,
    }
    with capture_logs() as logs:
        together, ran = run_still(batched, db, scenario)
    assert ran == [None]
    assert [result is not None for result in together] == [True, False, True, True]
    declined = [log for log in logs if log["event"] == "common_entry_declined"]
    assert [log.get("group") for log in declined] == [4, None]  # the group, then T1 alone


async def _with_an_hourly_rate(db: Path | str, scenario: dict[str, Any]) -> tuple[list[Any], list[Any], int]:
    async with open_runtime(db, clock=FakeClock()) as rt:
        admissions = await prepare(rt, scenario)
        await ok(rt, {"type": "set_limits", "scope": "agent", "id": "rev-a", "runs_per_hour": 100})
        results, ran = await one_batch(rt, admissions)
        count = await rt.services.store.transact(
            lambda conn: conn.execute("SELECT count(*) FROM runs").fetchone()
        )
        return results, ran, int(count[0])


def declined_for_an_hourly_rate(db: Path | str) -> None:
    """An hourly rate is set: every new run must be counted at its enqueue, so the group declines (each
    entry then takes the per-action path) and writes nothing."""
    scenario = {
        "review": ["clear", "fan_out"],
        "seats": ["rev-a"],
        "before": dict.fromkeys(TASKS, "fresh"),
        "cached": dict.fromkeys(TASKS, False),
        "order": TASKS,
    }
    together, ran, runs_written = run_still(_with_an_hourly_rate, db, scenario)
    assert ran == [None]
    assert together == [None] * len(TASKS)  # the common path alone declines too
    assert runs_written == 0


def test_an_hourly_rate_declines_the_group(tmp_path: Path) -> None:
    declined_for_an_hourly_rate(tmp_path / "together.db")


def test_a_clean_batch_is_admitted_by_one_group_run(tmp_path: Path) -> None:
    """Not vacuous: entries with nothing in the way are decided by the group, and its result is each one's."""
    admitted_by_one_group_run(tmp_path / "together.db")


def test_one_anomaly_sends_the_whole_group_back_to_one_at_a_time(tmp_path: Path) -> None:
    """T1's first key is taken in advance: the group is rolled back and each entry decided alone."""
    sent_back_one_at_a_time(tmp_path / "together.db")


async def moved_at_once(db: Path | str) -> list[Any]:
    """Review's on_enter a clear and a fan-out to rev-a and rev-b; 32 tasks created, then moved to review
    at once through `Runtime.send`; their replies, in task order."""
    async with open_runtime(db, clock=FakeClock()) as rt:
        text = workflow_yaml(["clear", "fan_out"], 0)
        await ok(rt, {"type": "register_workflow", "yaml": text, "source": "t.yml", "import_path": True})
        for agent in ("rev-a", "rev-b"):
            message = {"type": "add_participant", "workflow_id": "common", "step_id": "review"}
            await ok(rt, message | {"role": "reviewer", "agent_profile_id": agent})
        ids = [f"M{i}" for i in range(32)]
        for task_id in ids:
            await ok(rt, {"type": "create_task", "task_id": task_id, "workflow_id": "common"})
        replies: dict[str, Any] = {}

        async def move(task_id: str) -> None:
            message = {"type": "move_task", "task_id": task_id, "step_id": "review"}
            replies[task_id] = await ok(rt, message)

        async with trio.open_nursery() as nursery:
            for task_id in ids:
                nursery.start_soon(move, task_id)
        return [replies[task_id] for task_id in ids]


def test_concurrent_moves_share_group_runs_and_every_entry_completes(tmp_path: Path) -> None:
    """End to end through `Runtime.send`: 32 tasks moved at once are admitted by group runs (the writer's
    batches), and every entry has its markers, its clear and one run per seat; the replies carry them."""
    calls: list[int] = []
    original = admission.admit_group

    def counted(conn: sqlite3.Connection, admissions: list[Admission]) -> Any:
        admitted = original(conn, admissions)
        calls.append(len(admissions) if admitted is not None else 0)
        return admitted

    admission.admit_group = counted  # type: ignore[assignment]
    try:
        replies = run_still(moved_at_once, tmp_path / "moves.db")
    finally:
        admission.admit_group = original
    assert sum(calls) >= 16 and 0 not in calls  # most entries went through groups, none declined
    for reply in replies:
        types = [event.type for event in reply.events]
        assert types.count("run_queued") == 2 and "decisions_cleared" in types
    conn = sqlite3.connect(tmp_path / "moves.db")
    TABLES = ("step_entries", "step_entry_markers")
    try:
        assert conn.execute("SELECT count(*), sum(terminal) FROM step_entries").fetchone() == (32, 32)
        state = unfolded({table: conn.execute(f"SELECT * FROM {table}").fetchall() for table in TABLES})
        assert [marker[5] for marker in state["step_entry_markers"]] == ["done"] * 64
        assert conn.execute(f"SELECT count(DISTINCT {keys.STORED_KEY_SQL}) FROM runs").fetchone() == (64,)
    finally:
        conn.close()


def test_the_writer_rolls_back_a_group_that_declines(tmp_path: Path) -> None:
    """store/writer.py `Grouped`: a group run that wrote and then returned None leaves nothing; each request
    then runs its own fn, in arrival order."""

    def declines(conn: sqlite3.Connection, items: list[str]) -> None:
        conn.executemany("INSERT INTO marks VALUES (?)", [(f"group-{item}",) for item in items])
        return None

    def own(item: str) -> Any:
        return lambda conn: conn.execute("INSERT INTO marks VALUES (?)", (item,)).rowcount

    async def main() -> list[str]:
        async with open_runtime(tmp_path / "w.db", clock=FakeClock()) as rt:
            store = rt.services.store
            await store.transact(lambda conn: conn.execute("CREATE TABLE marks (v TEXT)"))
            release = threading.Event()
            async with trio.open_nursery() as nursery:
                hold, started = holding(release)
                nursery.start_soon(store.transact, hold)
                await trio.to_thread.run_sync(started.wait, 10)
                for item in ("a", "b", "c"):
                    nursery.start_soon(store.transact_grouped, Grouped("k", item, declines), own(item))
                    await trio.testing.wait_all_tasks_blocked()
                release.set()
            rows = await store.transact(lambda conn: conn.execute("SELECT v FROM marks").fetchall())
            return [value for (value,) in rows]

    assert run_still(main) == ["a", "b", "c"]
