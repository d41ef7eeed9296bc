"""The common paths on PostgreSQL: the one-savepoint common entry and the set-oriented recovery decide
exactly as the per-action / per-entry paths do, there too.

The SQL of both paths is written once per dialect where the two differ (store/backends/dialect.py: the JSON
arrays as rows, the ordered joins), and the writer runs it pipelined. These are the common paths'
equivalence tests (tests/on_enter/test_common_entry.py, test_recovery_set.py) replayed on a PostgreSQL
database per run, with their scenarios, plus the database-error case as a PostgreSQL trigger: the failing
statement is one whose answer the pipeline reads late, so it also checks that its error is raised inside the
savepoint that issued it. The databases are compared by SQL; replies, events and logs as they are.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hand_clock import run_still
from helpers import START, FakeClock, send
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pg_support import PostgresServer, freeze_server_clock
from structlog.testing import capture_logs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "on_enter"))

import test_common_entry as common
import test_recovery_set as recovery_set
from entry_support import REVIEWERS, SNAPSHOT_TABLES, new_task, setup_entries, unfolded

import onceflow.store.entries.admission as admission
import onceflow.store.entries.recovery as recovery
from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.events import Event
from onceflow.store.writer import open_store

_names = itertools.count(1)


def snapshot(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """The tables, rows in order, with `rowid` columns left out, run ids replaced by their rank
    (`run_ranks`): PostgreSQL's identity values are not transactional, so a savepoint the common path rolled
    back leaves a gap in them that SQLite would have reused; and an entry's creating epoch by whether it has
    one (each database's runtime mints its own)."""
    ranks = run_ranks(url)
    state: dict[str, list[tuple[Any, ...]]] = {}
    with psycopg.connect(url) as conn:
        for table in SNAPSHOT_TABLES:
            cur = conn.execute(f"SELECT {COLUMNS.get(table, '*')} FROM {table}")
            names = [column.name for column in cur.description or ()]
            rows = []
            for row in cur.fetchall():
                kept = []
                for name, value in zip(names, row, strict=True):
                    if name == "rowid":
                        continue
                    if name == "created_epoch":
                        value = value is not None
                    run_id = (table == "runs" and name == "id") or name == "run_id"
                    kept.append(ranks.get(value, value) if run_id else value)
                rows.append(tuple(kept))
            state[table] = sorted(rows, key=repr)
        digests = dict(conn.execute("SELECT id, digest FROM digests").fetchall())
    return unfolded(state, digests)


COLUMNS = {
    "step_entries": "task_id, step_id, entry_seq, workflow_id, declaration_digest, entry_path, terminal,"
    " created_at, created_epoch, done_markers"
}
"""SQLite's column order where PostgreSQL's differs (migration 23 moved the declaration digest's column)."""


def run_ranks(url: str) -> dict[int, int]:
    """Each run id of the database at `url` → its rank (1 = the oldest run)."""
    with psycopg.connect(url) as conn:
        ids = [int(run_id) for (run_id,) in conn.execute("SELECT id FROM runs ORDER BY id").fetchall()]
    return {run_id: rank for rank, run_id in enumerate(ids, 1)}


def renumbered(value: Any, ranks: dict[int, int]) -> Any:
    """`value` (replies, events or logs as plain data) with every run id (`run_id`, `existing_run_id`)
    replaced by its rank: PostgreSQL's sequence is not rolled back with a savepoint, so the two paths may
    number the same runs differently."""
    if isinstance(value, dict):
        return {
            k: ranks.get(v, v) if k.endswith("run_id") else renumbered(v, ranks) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(renumbered(v, ranks) for v in value)
    return value


def fresh(server: PostgresServer, template: str | None = None) -> str:
    """A new database on `server` (a copy of database `template` when given); its URL. Its server clock
    stands at `START` (pg_support.freeze_server_clock), so two runs on Trio's still clock (`run_still`) stamp
    the same times."""
    name = f"cp{next(_names)}"
    if template is None:
        url = server.create_database(name)
    else:
        with psycopg.connect(server.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        url = server.url(name)
    freeze_server_clock(url, START)
    return url


# --- the common entry ---------------------------------------------------------------------------------


def same_outcome(server: PostgresServer, scenario: dict[str, Any]) -> list[Any]:
    fast, slow = fresh(server), fresh(server)
    fast_replies, fast_logs = run_still(common.play, fast, scenario)
    with common.per_action_only():
        slow_replies, slow_logs = run_still(common.play, slow, scenario)
    assert snapshot(fast) == snapshot(slow)
    fast_ranks, slow_ranks = run_ranks(fast), run_ranks(slow)
    assert renumbered(fast_replies, fast_ranks) == renumbered(slow_replies, slow_ranks)
    fast_logs = [log for log in fast_logs if log["event"] != "common_entry_declined"]
    assert renumbered(fast_logs, fast_ranks) == renumbered(slow_logs, slow_ranks)
    return fast_replies


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=common.scenarios)
def test_the_common_entry_decides_every_admission_as_the_per_action_path_on_postgres(
    postgres_server: PostgresServer, scenario: dict[str, Any]
) -> None:
    same_outcome(postgres_server, scenario)


@pytest.mark.parametrize(("before", "expected"), common.ANOMALIES.values(), ids=common.ANOMALIES.keys())
def test_an_anomaly_takes_the_per_action_path_on_postgres(
    postgres_server: PostgresServer, before: list[str], expected: str
) -> None:
    scenario = {
        "review": ["clear", "fan_out"],
        "wip_limit": 0,
        "seats": ["rev-a"] if before else ["rev-a", ""],
        "commands": [(command, "T0") for command in before] + [("move_review", "T0")],
    }
    replies = same_outcome(postgres_server, scenario)
    assert expected in common.event_types(replies[-1])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seats=st.lists(common.SEAT, max_size=7), payload=st.booleans())
def test_the_runs_statement_seats_a_fan_out_as_dedupe_seats_does_on_postgres(
    postgres_server: PostgresServer, seats: list[tuple[str, str, int, str | None]], payload: bool
) -> None:
    """The common path's SQL-built runs (participants read, deduplicated, keyed and ordered by the database)
    are the per-action path's seats on PostgreSQL too (AC-A5, AC-E2): test_common_entry's examples, each in
    one writer request rolled back at its end, on one database."""
    run_still(common.play_seats, seats_database(postgres_server), seats, payload)


_seats_url: list[str] = []


def seats_database(server: PostgresServer) -> str:
    """One database for every seats example (each rolls its request back)."""
    if not _seats_url:
        _seats_url.append(fresh(server))
    return _seats_url[0]


def counting(name: str, module: Any) -> tuple[list[Any], Callable[[], None]]:
    """Wrap `module.name` to record what each call returned; returns the record and the undo."""
    calls: list[Any] = []
    original = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        calls.append(result)
        return result

    setattr(module, name, counted)
    return calls, lambda: setattr(module, name, original)


def test_the_common_entry_path_is_taken_on_postgres(pg_url: str) -> None:
    """Not vacuous: on PostgreSQL an untouched common entry is admitted by the one-savepoint path."""
    calls, undo = counting("admit_common", admission)
    try:
        scenario = {
            "review": ["clear", "fan_out"],
            "wip_limit": 0,
            "seats": ["rev-a", "rev-b"],
            "commands": [("decide", "T0"), ("move_review", "T0")],
        }
        replies = run_still(common.play, pg_url, scenario)[0]
    finally:
        undo()
    assert [admitted is not None for admitted in calls] == [True]
    assert common.event_types(replies[-1]).count("run_queued") == 2
    assert "decisions_cleared" in common.event_types(replies[-1])


REFUSE = """
CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN IF NEW.task_id = 'T0' THEN RAISE EXCEPTION 'refused'; END IF; RETURN NEW; END $$;
CREATE TRIGGER refuse BEFORE INSERT ON runs FOR EACH ROW EXECUTE FUNCTION refuse();
"""


def test_a_database_error_in_the_common_path_rolls_back_to_the_per_action_path_on_postgres(
    postgres_server: PostgresServer,
) -> None:
    """A statement of the common path failing on PostgreSQL (a trigger refusing T0's runs) rolls back only
    its savepoint, is logged (common_entry_declined), and the per-action path decides the entry as it would
    alone: the clear stands, the fan-out is marked failed (AC-C1)."""

    async def run(url: str) -> tuple[Any, list[dict[str, Any]], dict[str, list[tuple[Any, ...]]]]:
        async with open_runtime(url, clock=FakeClock()) as rt:
            await common.one_reviewer_task(rt)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(REFUSE)
            with capture_logs() as logs:
                reply = await send(rt, {"type": "move_task", "task_id": "T0", "step_id": "review"})
        return reply.model_dump(), logs, snapshot(url)

    fast_reply, fast_logs, fast_state = run_still(run, fresh(postgres_server))
    with common.per_action_only():
        slow_reply, slow_logs, slow_state = run_still(run, fresh(postgres_server))
    assert [log["event"] for log in fast_logs].count("common_entry_declined") == 1
    assert [log for log in fast_logs if log["event"] != "common_entry_declined"] == slow_logs
    assert fast_reply == slow_reply
    assert fast_state == slow_state
    assert [row[3:6] for row in fast_state["step_entry_markers"]] == [
        (0, "clear_decisions", "done"),
        (1, "queue_run_for_each_participant", "failed"),
    ]


# --- the set-oriented recovery ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(postgres_server: PostgresServer) -> str:
    """The name of a closed database: `entries` registered, two template reviewers, six tasks at work."""
    url = fresh(postgres_server)

    async def prepare() -> None:
        async with open_runtime(url, clock=FakeClock()) as rt:
            await setup_entries(rt, recovery_set.REVIEW)
            for task_id in recovery_set.TASKS:
                await new_task(rt, task_id)

    run_still(prepare)
    return url.rsplit("/", 1)[1]


async def restart(url: str, *, listening: bool) -> tuple[list[Event], list[dict[str, Any]]]:
    """`test_recovery_set.restart` on PostgreSQL."""
    return await recovery_set.restart(url, listening=listening)


def crashed(server: PostgresServer, prepared: str, scenario: dict[str, Any]) -> str:
    url = fresh(server, prepared)

    async def crash_state() -> None:
        async with open_store(url) as store:
            await store.transact(lambda conn: recovery_set.write_state(conn, scenario))

    run_still(crash_state)
    return url


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=recovery_set.scenarios)
def test_the_set_path_recovers_every_crash_state_as_the_per_entry_path_on_postgres(
    postgres_server: PostgresServer, prepared: str, scenario: dict[str, Any]
) -> None:
    dbs = {name: crashed(postgres_server, prepared, scenario) for name in ("set", "per_entry", "quiet")}
    set_events, set_logs = run_still(lambda: restart(dbs["set"], listening=True))
    with recovery_set.per_entry_only():
        slow_events, slow_logs = run_still(lambda: restart(dbs["per_entry"], listening=True))
    quiet_events, quiet_logs = run_still(lambda: restart(dbs["quiet"], listening=False))
    assert snapshot(dbs["set"]) == snapshot(dbs["per_entry"]) == snapshot(dbs["quiet"])
    ranks = {name: run_ranks(url) for name, url in dbs.items()}
    set_dumped = renumbered([event.model_dump() for event in set_events], ranks["set"])
    assert set_dumped == renumbered([event.model_dump() for event in slow_events], ranks["per_entry"])
    assert quiet_events == []
    same = recovery_set.same_for_both
    assert renumbered(same(set_logs), ranks["set"]) == renumbered(slow_logs, ranks["per_entry"])
    assert renumbered(same(quiet_logs), ranks["quiet"]) == renumbered(slow_logs, ranks["per_entry"])


def test_the_set_path_takes_the_common_entries_on_postgres(
    postgres_server: PostgresServer, prepared: str
) -> None:
    """Not vacuous: on PostgreSQL the start-up scan finishes untouched open entries set-wise, several in one
    savepoint (the multi-row marker insert over two json_each, the row-value terminal UPDATE) under their
    tasks' locks, with the per-entry path's result (AC-B9)."""
    url = crashed(postgres_server, prepared, recovery_set.COMMON)
    calls, undo = counting("finish_common", recovery)
    try:
        run_still(lambda: restart(url, listening=False))
    finally:
        undo()
    assert [len(done.entries) if done is not None else 0 for done in calls] == [3]
    state = snapshot(url)
    assert len(state["runs"]) == 3 * 2 * len(REVIEWERS)
    assert all(row[6] == 1 for row in state["step_entries"])  # terminal
    assert state["decisions"] == []
    slow = crashed(postgres_server, prepared, recovery_set.COMMON)
    with recovery_set.per_entry_only():
        run_still(lambda: restart(slow, listening=False))
    assert snapshot(url) == snapshot(slow)
