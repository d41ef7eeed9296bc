"""The recovery scan's set-oriented common case decides every entry exactly as the per-entry path does.

Recovery: set-oriented SQL for the common case, the per-entry path for the rest; the rules
compared are AC-B9 (a1) (a2) (b) (c) (d), AC-B5, AC-B6 and AC-C1's keys. Each example writes a random crash
state (entries open, superseded, left, with markers, a changed digest, per-task seats, taken or merged keys,
a seat without an agent) into a copy of one prepared database, then restarts three copies: the set path with
a subscriber on the hub, the per-entry path alone with a subscriber, and the set path with nobody listening
(as at every real start). The database, the events and the diagnostics logged must be the same.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from entry_support import (
    REVIEWERS,
    WF,
    add_decision,
    admit,
    commit_clear,
    entries_yaml,
    kinds_of,
    mark,
    new_task,
    run_rows,
    setup_entries,
    snapshot,
)
from hand_clock import run_still
from helpers import START, FakeClock
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

import onceflow.actors.runtime.startup as supervisor
import onceflow.store.entries.recovery as recovery
from onceflow.actors.kernel.outbox import EventHub
from onceflow.actors.kernel.services import Services
from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.events import Event
from onceflow.store.entries import participants
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.runs import runs
from onceflow.store.runs.keys import config_digest
from onceflow.store.tasks import tasks
from onceflow.store.writer import open_store

REVIEW = """
- type: clear_decisions
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: r1}
- type: queue_run_for_each_participant
  config: {role: reviewer}
"""
KINDS = kinds_of(entries_yaml(REVIEW), "review")
TASKS = tuple(f"T{i}" for i in range(6))


def fan_out_key(key: EntryKey, position: int, agent: str, reason: str) -> str:
    digest = config_digest({"role": "reviewer", "reason": reason, "payload": None})
    return f"on_enter:{key.task_id}:{key.step_id}:{key.entry_seq}:{position}:{agent}:{digest}"


def mostly(common: str, *rare: str) -> st.SearchStrategy[str]:
    """`common` three times in four, else one of `rare`: most entries must reach the set path."""
    return st.integers(0, 3).flatmap(lambda n: st.just(common) if n else st.sampled_from(rare))


def seldom() -> st.SearchStrategy[bool]:
    return st.integers(0, 7).map(lambda n: n == 0)


task_states = st.fixed_dictionaries(
    {
        "entries": mostly("open", "none", "superseded", "left", "reentered_done"),
        "markers": mostly("none", "clear_done", "clear_stale", "clear_failed", "fan_out_done"),
        "decisions": st.integers(0, 2),
        "own_seat": seldom(),
        "taken_key": seldom(),
        "merged_key": seldom(),
        "old_digest": seldom(),
    }
)
scenarios = st.fixed_dictionaries(
    {"tasks": st.lists(task_states, min_size=1, max_size=len(TASKS)), "seat_without_agent": seldom()}
)


def write_state(conn: sqlite3.Connection, scenario: dict[str, Any]) -> None:
    """What a killed runtime leaves behind, per task (one transaction on the closed file)."""
    if scenario["seat_without_agent"]:
        participants.add_participant(
            conn,
            workflow_id=WF,
            step_id="review",
            task_id=None,
            role="reviewer",
            agent_profile_id="",
            decision_required=True,
            position=9,
        )
    for task_id, state in zip(TASKS, scenario["tasks"], strict=False):
        kinds = ["clear_decisions"] if state["old_digest"] else KINDS
        for _ in range(state["decisions"]):
            add_decision(conn, task_id, "review")
        if state["own_seat"]:
            participants.add_participant(
                conn,
                workflow_id=WF,
                step_id="review",
                task_id=task_id,
                role="reviewer",
                agent_profile_id="rev-own",
                decision_required=True,
                position=5,
            )
        if state["entries"] == "none":
            continue
        key = admit(conn, task_id, "review", kinds)
        if state["entries"] in ("superseded", "reentered_done"):
            admit(conn, task_id, "work", [])
            newer = admit(conn, task_id, "review", kinds)
            if state["entries"] == "reentered_done":
                conn.execute(
                    "UPDATE step_entries SET terminal = 1 WHERE task_id = ? AND entry_seq = ?",
                    (task_id, newer.entry_seq),
                )
            else:
                key = newer
        elif state["entries"] == "left":
            task = tasks.get_task(conn, task_id)
            tasks.move_task_step(
                conn,
                task_id=task_id,
                expected_step_id=task.step_id,
                workflow_id=WF,
                step_id="done",
                now=START,
            )
        if state["markers"] == "clear_done":
            commit_clear(conn, key)
        elif state["markers"] == "clear_stale":
            mark(conn, key, 0, "clear_decisions", "in_progress")
        elif state["markers"] == "clear_failed":
            mark(conn, key, 0, "clear_decisions", "failed")
        elif state["markers"] == "fan_out_done":
            mark(conn, key, 1, "queue_run_for_each_participant", "done")
        request = runs.RunRequest(REVIEWERS[0], task_id, "review", "r1", None, None)
        if state["taken_key"]:
            taken = attrs_evolve_key(request, fan_out_key(key, 1, REVIEWERS[0], "r1"))
            runs.enqueue_run(conn, taken, START)
        if state["merged_key"]:
            run = runs.enqueue_run(conn, request, START)
            conn.execute(
                "INSERT INTO coalesced_keys (idempotency_key, run_id, seen_at) VALUES (?, ?, ?)",
                (fan_out_key(key, 2, REVIEWERS[1], "on_enter"), run.run_id, START),
            )


def attrs_evolve_key(request: runs.RunRequest, key: str) -> runs.RunRequest:
    return runs.RunRequest(
        request.agent_profile_id, request.task_id, request.step_id, request.reason, None, key, True
    )


@contextmanager
def per_entry_only() -> Iterator[None]:
    """The per-entry path alone: the set path finds no common entry."""
    original = recovery.plan_common
    recovery.plan_common = lambda conn, plans, batch: {}  # type: ignore[assignment]
    try:
        yield
    finally:
        recovery.plan_common = original


async def restart(db: Path | str, *, listening: bool) -> tuple[list[Event], list[dict[str, Any]]]:
    """Open a runtime on `db` (a SQLite file, or a PostgreSQL URL: the supervisor's start-up scan observed);
    the events a subscriber present during the scan received (none when not `listening`) and the logs of
    the scan."""
    events: list[Event] = []
    logs: list[dict[str, Any]] = []
    scan = supervisor.recover_open_entries

    async def observed(services: Services, hub: EventHub) -> int:
        stream = hub.subscribe() if listening else None
        with capture_logs() as captured:
            done = await scan(services, hub)
        logs.extend(captured)
        while stream is not None:
            try:
                events.append(stream.receive_nowait())
            except trio.WouldBlock:
                break
        return done

    supervisor.recover_open_entries = observed  # type: ignore[assignment]
    try:
        async with open_runtime(db, clock=FakeClock()):
            pass
    finally:
        supervisor.recover_open_entries = scan
    return events, logs


def same_for_both(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The scan's logs but the set path's own note that it declined a run of entries."""
    return [log for log in logs if log["event"] != "recovery_set_path_declined"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A closed database: `entries` registered, two template reviewers at review, six tasks at work."""
    db = tmp_path_factory.mktemp("prepared") / "base.db"

    async def prepare() -> None:
        async with open_runtime(db, clock=FakeClock()) as rt:
            await setup_entries(rt, REVIEW)
            for task_id in TASKS:
                await new_task(rt, task_id)

    run_still(prepare)
    return db


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=scenarios)
def test_the_set_path_recovers_every_crash_state_as_the_per_entry_path_does(
    prepared: Path, tmp_path: Path, scenario: dict[str, Any]
) -> None:
    dbs = {name: tmp_path / f"{name}.db" for name in ("set", "per_entry", "quiet")}
    for db in dbs.values():
        for suffix in ("-wal", "-shm", ""):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        shutil.copy(prepared, db)

        async def crash_state(db: Path = db) -> None:
            async with open_store(db) as store:
                await store.transact(lambda conn: write_state(conn, scenario))

        run_still(crash_state)
    set_events, set_logs = run_still(lambda: restart(dbs["set"], listening=True))
    with per_entry_only():
        slow_events, slow_logs = run_still(lambda: restart(dbs["per_entry"], listening=True))
    quiet_events, quiet_logs = run_still(lambda: restart(dbs["quiet"], listening=False))
    assert snapshot(dbs["set"]) == snapshot(dbs["per_entry"]) == snapshot(dbs["quiet"])
    assert set_events == slow_events
    assert quiet_events == []
    assert same_for_both(set_logs) == slow_logs == same_for_both(quiet_logs)


@pytest.mark.parametrize("listening", [False, True])
def test_the_set_path_takes_the_common_entries(prepared: Path, tmp_path: Path, listening: bool) -> None:
    """The equivalence above is not vacuous: untouched entries are finished by the set path, whether the
    events are built (a subscriber) or not (as at every real start)."""
    db = tmp_path / "common.db"
    shutil.copy(prepared, db)
    scenario = {
        "seat_without_agent": False,
        "tasks": [
            {
                "entries": "open",
                "markers": "none",
                "decisions": 1,
                "own_seat": False,
                "taken_key": False,
                "merged_key": False,
                "old_digest": False,
            }
        ]
        * 3,
    }

    async def crash_state() -> None:
        async with open_store(db) as store:
            await store.transact(lambda conn: write_state(conn, scenario))

    run_still(crash_state)
    with counting_finishes() as calls:
        events, logs = run_still(lambda: restart(db, listening=listening))
    assert calls == [3]
    assert same_for_both(logs) == logs  # not declined
    assert len([e for e in events if e.type == "run_queued"]) == (3 * 2 * len(REVIEWERS) if listening else 0)
    state = snapshot(db)
    assert len(state["runs"]) == 3 * 2 * len(REVIEWERS)
    assert all(row[6] == 1 for row in state["step_entries"])  # terminal
    assert state["decisions"] == []


@contextmanager
def counting_finishes() -> Iterator[list[int]]:
    """The number of entries each `finish_common` call finished (0: declined) while inside."""
    calls: list[int] = []
    finish = recovery.finish_common

    def counted(*args: Any, **kwargs: Any) -> Any:
        done = finish(*args, **kwargs)
        calls.append(len(done.entries) if done is not None else 0)
        return done

    recovery.finish_common = counted  # type: ignore[assignment]
    try:
        yield calls
    finally:
        recovery.finish_common = finish


ODD = """
- type: clear_decisions
- type: queue_run_for_each_participant
  config:
    role: reviewer
    payload:
      note: 'héllo "quoted" \u2603'
      n: 1
"""
ODD_TASKS = ("T:1", "Tä'\"2", "T 3;\\", "T-\U0001f600")
ODD_REVIEWERS = ("rév:1", "rev'2")


@pytest.mark.parametrize("listening", [False, True])
def test_the_set_path_writes_the_per_entry_paths_keys_byte_for_byte(tmp_path: Path, listening: bool) -> None:
    """The set path builds idempotency keys, payloads and reasons in SQL: for task and agent ids with colons,
    quotes, non-ASCII and astral characters, an entry_seq of two digits and a non-ASCII payload, every row
    is the per-entry path's (AC-C1 keys, AC-H2 payloads)."""
    base = tmp_path / "odd.db"

    async def prepare() -> None:
        async with open_runtime(base, clock=FakeClock()) as rt:
            await setup_entries(rt, ODD, reviewers=ODD_REVIEWERS)
            for task_id in ODD_TASKS:
                await new_task(rt, task_id)

    def crash_state(conn: sqlite3.Connection) -> None:
        kinds = kinds_of(entries_yaml(ODD), "review")
        for task_id in ODD_TASKS:
            for _ in range(11):  # entry_seq 11 is left open: earlier entries closed as a finished one is
                key = admit(conn, task_id, "review", kinds)
                conn.execute(
                    "UPDATE step_entries SET terminal = 1 WHERE task_id = ? AND entry_seq = ?",
                    (task_id, key.entry_seq),
                )
            key = admit(conn, task_id, "review", kinds)
            assert key.entry_seq >= 10
            add_decision(conn, task_id, "review")

    run_still(prepare)

    async def crash() -> None:
        async with open_store(base) as store:
            await store.transact(crash_state)

    run_still(crash)
    dbs = {name: tmp_path / f"{name}.db" for name in ("set", "per_entry")}
    for db in dbs.values():
        shutil.copy(base, db)
    with counting_finishes() as calls:
        run_still(lambda: restart(dbs["set"], listening=listening))
    assert calls == [len(ODD_TASKS)]
    with per_entry_only():
        run_still(lambda: restart(dbs["per_entry"], listening=listening))
    assert snapshot(dbs["set"]) == snapshot(dbs["per_entry"])
    conn = sqlite3.connect(dbs["set"])
    keys = [row[3] for row in run_rows(conn)]  # read back from the parts they are stored by
    conn.close()
    assert len(keys) == len(ODD_TASKS) * len(ODD_REVIEWERS)
    assert all(key.startswith("on_enter:") and ":review:" in key for key in keys)


COMMON = {
    "seat_without_agent": False,
    "tasks": [
        {
            "entries": "open",
            "markers": "none",
            "decisions": 1,
            "own_seat": False,
            "taken_key": False,
            "merged_key": False,
            "old_digest": False,
        }
    ]
    * 3,
}


def crash_with_trigger(prepared: Path, db: Path, trigger: str) -> None:
    """Copy `prepared` to `db`, leave three untouched open entries and install `trigger`."""
    shutil.copy(prepared, db)

    def write(conn: sqlite3.Connection) -> None:
        write_state(conn, COMMON)
        conn.execute(trigger)

    async def run() -> None:
        async with open_store(db) as store:
            await store.transact(write)

    run_still(run)


def test_an_error_ending_the_transaction_in_the_set_path_fails_the_batch_whole(
    prepared: Path, tmp_path: Path
) -> None:
    """SQLite leaves the transaction inside the multi-row runs insert: nothing of the batch commits (no
    decision deleted, no marker, no entry terminal), and the next start, without the fault, is exact."""
    db = tmp_path / "ended.db"
    crash_with_trigger(
        prepared,
        db,
        "CREATE TRIGGER gone BEFORE INSERT ON runs BEGIN SELECT RAISE(ROLLBACK, 'transaction gone'); END",
    )
    before = snapshot(db)
    _, logs = run_still(lambda: restart(db, listening=False))
    assert snapshot(db) == before
    assert [log["task_id"] for log in logs if log["event"] == "recovery_entry_failed"] == list(TASKS[:3])
    conn = sqlite3.connect(db)
    conn.execute("DROP TRIGGER gone")
    conn.commit()
    conn.close()
    run_still(lambda: restart(db, listening=False))
    state = snapshot(db)
    assert len(state["runs"]) == 3 * 2 * len(REVIEWERS)
    assert state["decisions"] == []
    assert all(row[6] == 1 for row in state["step_entries"])


def test_a_statement_failing_in_the_set_path_leaves_the_entries_to_the_per_entry_path(
    prepared: Path, tmp_path: Path
) -> None:
    """A constraint failure inside the set statements rolls back its savepoint only; the per-entry path then
    decides every entry of the run exactly as it would alone (T1's fan-out fails there, AC-C1)."""
    trigger = (
        "CREATE TRIGGER refuse BEFORE INSERT ON runs WHEN NEW.task_id = 'T1'"
        " BEGIN SELECT RAISE(ABORT, 'refused'); END"
    )
    dbs = {name: tmp_path / f"{name}.db" for name in ("set", "per_entry")}
    for db in dbs.values():
        crash_with_trigger(prepared, db, trigger)
    set_events, set_logs = run_still(lambda: restart(dbs["set"], listening=True))
    with per_entry_only():
        slow_events, slow_logs = run_still(lambda: restart(dbs["per_entry"], listening=True))
    assert len(set_logs) == len(same_for_both(set_logs)) + 1  # the set path declined the run once
    assert snapshot(dbs["set"]) == snapshot(dbs["per_entry"])
    assert set_events == slow_events
    assert same_for_both(set_logs) == slow_logs
    assert [log["task_id"] for log in slow_logs if log["event"] == "fan_out_participant_failed"] == ["T1"] * 4


@contextmanager
def small_batches(size: int) -> Iterator[list[tuple[int, int]]]:
    """`BATCH_SIZE` = `size` (three batches per request) while inside; (entries offered, entries covered)
    per store request that committed."""
    requests: list[tuple[int, int]] = []
    original = recovery.BATCH_SIZE, recovery.REQUEST_SIZE, recovery.recover_request

    def recorded(conn: Any, plans: Any, entries: list[Any], *args: Any) -> Any:
        recovered, covered = original[2](conn, plans, entries, *args)
        requests.append((len(entries), covered))
        return recovered, covered

    recovery.BATCH_SIZE, recovery.REQUEST_SIZE = size, 3 * size
    recovery.recover_request = recorded  # type: ignore[assignment]
    try:
        yield requests
    finally:
        recovery.BATCH_SIZE, recovery.REQUEST_SIZE, recovery.recover_request = original


def test_one_store_request_covers_set_path_batches_but_a_batch_decided_one_by_one_ends_it(
    prepared: Path, tmp_path: Path
) -> None:
    """Six untouched entries in batches of two: one request covers all three batches; the same entries
    decided one by one take a request per batch (each request decides about `BATCH_SIZE` entries one by one
    at most, so the events it holds stay bounded)."""
    scenario = {"seat_without_agent": False, "tasks": [COMMON["tasks"][0]] * len(TASKS)}  # type: ignore[index]
    dbs = {name: tmp_path / f"{name}.db" for name in ("set", "per_entry")}
    for db in dbs.values():
        shutil.copy(prepared, db)

        async def crash_state(db: Path = db) -> None:
            async with open_store(db) as store:
                await store.transact(lambda conn: write_state(conn, scenario))

        run_still(crash_state)
    with small_batches(2) as requests:
        run_still(lambda: restart(dbs["set"], listening=False))
    assert requests == [(6, 6)]
    with small_batches(2) as requests, per_entry_only():
        run_still(lambda: restart(dbs["per_entry"], listening=False))
    assert requests == [(6, 2), (4, 2), (2, 2)]
    assert snapshot(dbs["set"]) == snapshot(dbs["per_entry"])


def test_a_request_failing_in_a_later_batch_fails_that_batch_only(prepared: Path, tmp_path: Path) -> None:
    """The transaction ends inside the third batch of a request (T4's runs): the request is tried again
    batch by batch, so T0 to T3 are recovered and only T4 and T5 are logged failed and left open (AC-B9(f));
    the next start, without the fault, finishes them."""
    db = tmp_path / "later.db"
    shutil.copy(prepared, db)
    scenario = {"seat_without_agent": False, "tasks": [COMMON["tasks"][0]] * len(TASKS)}  # type: ignore[index]

    def write(conn: sqlite3.Connection) -> None:
        write_state(conn, scenario)
        conn.execute(
            "CREATE TRIGGER gone BEFORE INSERT ON runs WHEN NEW.task_id = 'T4'"
            " BEGIN SELECT RAISE(ROLLBACK, 'transaction gone'); END"
        )

    async def crash() -> None:
        async with open_store(db) as store:
            await store.transact(write)

    run_still(crash)
    with small_batches(2) as requests:
        _, logs = run_still(lambda: restart(db, listening=False))
    assert requests == [(2, 2), (2, 2)]  # the committed ones: T0-T1, then T2-T3, each after a failed try
    assert [log["task_id"] for log in logs if log["event"] == "recovery_entry_failed"] == ["T4", "T5"]
    state = snapshot(db)
    assert [row[0] for row in state["step_entries"] if row[6] == 0] == ["T4", "T5"]
    assert len(state["runs"]) == 4 * 2 * len(REVIEWERS)
    conn = sqlite3.connect(db)
    conn.execute("DROP TRIGGER gone")
    conn.commit()
    conn.close()
    run_still(lambda: restart(db, listening=False))
    state = snapshot(db)
    assert len(state["runs"]) == 6 * 2 * len(REVIEWERS)
    assert all(row[6] == 1 for row in state["step_entries"])
