"""Group commit on PostgreSQL that is not round-trip bound: the writer's transaction runs in
psycopg's pipeline mode (`PgConnection.pipelined`), a statement's answer is waited for only where it is
read, and an error is still raised inside the savepoint, and the request, that issued the statement. Also
the connection's parameter style (numbered parameters) and the dialect's JSON rows.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
import trio

from onceflow.actors.runtime.startup import open_runtime
from onceflow.store.backends import epochs, faults, postgres
from onceflow.store.backends.dialect import POSTGRES
from onceflow.store.backends.postgres import PgConnection, statement_of
from onceflow.store.writer import open_store

TABLE = "CREATE TABLE items (id BIGINT PRIMARY KEY, name TEXT NOT NULL)"


def rows(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT id, name FROM items ORDER BY id").fetchall()


def test_numbered_parameters_become_positional_ones_in_their_order() -> None:
    statement = statement_of("SELECT ?2, ?1 WHERE x = ?1 AND y = ? AND z = '?' AND w LIKE 'a%'")
    assert statement.text == "SELECT %s, %s WHERE x = %s AND y = %s AND z = '?' AND w LIKE 'a%%'"
    assert statement.params_for(("a", "b", "c")) == ["b", "a", "a", "c"]
    assert statement_of("SELECT ? + ?").order is None  # unnumbered: the caller's order, as given


def test_the_parameter_style_is_all_the_connection_changes_in_a_statement() -> None:
    """SQLite's forms reach the server as written (and fail there): the PostgreSQL forms are written once,
    side by side (store/backends/dialect.py), not rewritten at run time."""
    sqlite_only = "SELECT value FROM json_each(?) AS e CROSS JOIN t AS u ON u.a = e.value WHERE x IS ?"
    assert statement_of(sqlite_only).text == sqlite_only.replace("?", "%s")
    assert statement_of("BEGIN IMMEDIATE").text == "BEGIN IMMEDIATE"
    assert statement_of("ROLLBACK TO request").control == ("ROLLBACK TO", "request")
    assert statement_of("ROLLBACK").control == ("ROLLBACK", "")
    assert statement_of("SAVEPOINT sp").control == ("SAVEPOINT", "sp")
    assert statement_of("SELECT 1").control is None


def test_json_rows_keys_count_from_zero_and_read_as_json_or_as_text(pg_url: str) -> None:
    conn = postgres.connect(pg_url)
    try:
        scalars = POSTGRES.json_rows("?", scalars=True)
        rows = conn.execute(f"SELECT key, value FROM {scalars}", ('["a", "b"]',)).fetchall()
        into = POSTGRES.json_rows("?", "j")
        read = conn.execute(f"SELECT j.key, j.value ->> 1 FROM {into}", ('[["a", "b"], ["c", "d"]]',))
        pairs = read.fetchall()
        with pytest.raises(psycopg.errors.InvalidParameterValue):  # its json_each reads objects only
            conn.execute("SELECT value FROM json_each(?) AS e", ('["a"]',))
    finally:
        conn.close()
    assert [tuple(row) for row in rows] == [(0, "a"), (1, "b")]
    assert [tuple(row) for row in pairs] == [(0, "b"), (1, "d")]


def test_a_pipelined_transaction_waits_only_where_an_answer_is_read(pg_url: str) -> None:
    """Ten unread inserts, one read, a commit: two round trips (the read, the commit), not twelve."""
    conn = postgres.connect(pg_url)
    try:
        conn.execute(TABLE)
        before = conn.round_trips
        with conn.pipelined():
            conn.execute("BEGIN")
            for i in range(10):
                conn.execute("INSERT INTO items (id, name) VALUES (?, ?)", (i, f"n{i}"))
            assert conn.scalar("SELECT count(*) FROM items") == 10
            conn.execute("SAVEPOINT a")  # nothing unread: no wait
            conn.execute("RELEASE a")
            conn.execute("COMMIT")
        assert conn.round_trips - before == 2
        assert not conn.in_transaction
    finally:
        conn.close()
    assert len(rows(pg_url)) == 10


def test_an_unread_statements_error_is_raised_inside_the_savepoint_that_issued_it(
    pg_url: str,
) -> None:
    """A failing insert nobody reads is raised at its savepoint's RELEASE, which then rolls the savepoint
    back (as SQLite's savepoint would have on the error): the transaction goes on and commits the rest."""
    conn = postgres.connect(pg_url)
    try:
        conn.execute(TABLE)
        with conn.pipelined():
            conn.execute("BEGIN")
            conn.execute("INSERT INTO items (id, name) VALUES (1, 'kept')")
            conn.execute("SAVEPOINT block")
            conn.execute("INSERT INTO items (id, name) VALUES (2, 'undone')")
            conn.execute("INSERT INTO items (id, name) VALUES (1, 'duplicate')")
            with pytest.raises(psycopg.errors.UniqueViolation):
                conn.execute("RELEASE block")
            assert conn.in_transaction
            conn.execute("INSERT INTO items (id, name) VALUES (3, 'after')")
            conn.execute("COMMIT")
    finally:
        conn.close()
    assert rows(pg_url) == [(1, "kept"), (3, "after")]


def test_a_read_raises_the_error_of_an_earlier_unread_statement(pg_url: str) -> None:
    """Answers come in order: reading a later statement raises the earlier failure (the one the caller
    would have seen first on SQLite), and a ROLLBACK TO after it still works."""
    conn = postgres.connect(pg_url)
    try:
        conn.execute(TABLE)
        with conn.pipelined():
            conn.execute("BEGIN")
            conn.execute("SAVEPOINT block")
            conn.execute("INSERT INTO items (id, name) VALUES (1, NULL)")
            with pytest.raises(psycopg.errors.NotNullViolation):
                conn.scalar("SELECT count(*) FROM items")
            conn.execute("ROLLBACK TO block")
            conn.execute("RELEASE block")
            conn.execute("INSERT INTO items (id, name) VALUES (1, 'ok')")
            conn.execute("COMMIT")
    finally:
        conn.close()
    assert rows(pg_url) == [(1, "ok")]


async def test_group_commit_gives_an_unread_statements_error_to_its_own_request(pg_url: str) -> None:
    """Three requests of three tasks in one batch, each with an insert whose answer it never reads; A and B
    insert the same key, so the second of them fails. Only that one gets the error; the others commit.
    Round trips from the release of the request holding the writer: its COMMIT, then one for BEGIN and the
    three task locks, one per request to settle its insert, one to resynchronise after the second's error,
    one for COMMIT."""
    gate = threading.Event()
    async with open_store(pg_url, max_batch=8) as store:
        await store.transact(lambda conn: conn.execute(TABLE).rowcount)
        results: dict[str, Any] = {}

        async def request(task_id: str, item: int) -> None:
            epochs.CURRENT_TASK.set(task_id)
            try:
                results[task_id] = await store.transact(
                    lambda conn: (
                        conn.execute("INSERT INTO items (id, name) VALUES (?, 'x')", (item,)) and item
                    )
                )
            except psycopg.errors.IntegrityError as exc:
                results[task_id] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.transact, lambda conn: gate.wait(10))  # hold the writer: the rest batch
            await trio.sleep(0.2)
            before = PgConnection.total_round_trips
            nursery.start_soon(request, "A", 1)
            nursery.start_soon(request, "B", 1)  # the same key: whichever runs second fails
            nursery.start_soon(request, "C", 3)
            await trio.sleep(0.2)
            gate.set()
        waited = PgConnection.total_round_trips - before
    failed = [task for task, result in results.items() if isinstance(result, psycopg.errors.IntegrityError)]
    assert len(failed) == 1 and failed[0] in "AB"  # Trio may run A or B first: the second one fails
    assert results["C"] == 3 and results["B" if failed == ["A"] else "A"] == 1
    assert rows(pg_url) == [(1, "x"), (3, "x")]
    assert waited == 1 + 1 + 3 + 1 + 1


async def test_a_common_entry_costs_a_handful_of_round_trips(pg_url: str) -> None:
    """The move into a step of a clear and a fan-out to two reviewers, admitted by the common entry and
    pipelined: at most 10 round trips for the whole command alone (measured: 10, i.e. the task read's batch:
    its lock, the read, COMMIT; the admission's batch: its lock, the step compare-and-set, the entry insert,
    the participants, the clear, the runs insert, COMMIT), against ~30 before pipelining and the common
    path on PostgreSQL. Under concurrency the locks and COMMITs are shared by a batch (bench/README.md)."""
    workflow = """
id: wf
name: WF
steps:
  - {id: work, name: Work, position: 0, is_start_step: true}
  - id: review
    name: Review
    position: 1
    events:
      on_enter:
        - type: clear_decisions
        - type: queue_run_for_each_participant
          config: {role: reviewer}
"""
    async with open_runtime(pg_url) as rt:
        await rt.send(
            {"type": "register_workflow", "yaml": workflow, "source": "wf.yml", "import_path": True}
        )
        for agent in ("rev-a", "rev-b"):
            message = {
                "type": "add_participant",
                "workflow_id": "wf",
                "step_id": "review",
                "role": "reviewer",
            }
            await rt.send(message | {"agent_profile_id": agent})
        await rt.send({"type": "create_task", "task_id": "T", "workflow_id": "wf"})
        before = PgConnection.total_round_trips
        reply = await rt.send({"type": "move_task", "task_id": "T", "step_id": "review"})
        waited = PgConnection.total_round_trips - before
    assert reply.ok
    assert [e.type for e in reply.events].count("run_queued") == 2
    assert waited <= 10


def test_a_connection_lost_mid_pipeline_is_an_io_fault_that_ends_the_transaction(pg_url: str) -> None:
    """The server ends the session while a pipelined transaction is open: the next read raises the I/O
    fault (retryable storage_io) and the connection reports itself broken, outside any transaction, so the
    writer fails the batch whole and reconnects."""
    conn = postgres.connect(pg_url)
    try:
        conn.execute(TABLE)
        pid = conn.scalar("SELECT pg_backend_pid()")
        with conn.pipelined():
            conn.execute("BEGIN")
            conn.execute("INSERT INTO items (id, name) VALUES (1, 'lost')")
            with psycopg.connect(pg_url, autocommit=True) as killer:
                killer.execute("SELECT pg_terminate_backend(%s)", (pid,))
            with pytest.raises(faults.DatabaseFault) as raised:
                conn.scalar("SELECT count(*) FROM items")
            assert faults.storage_kind(raised.value) == "io"
            assert conn.broken and not conn.in_transaction
    finally:
        conn.close()
    assert rows(pg_url) == []


def test_executemany_in_a_pipelined_transaction_answers_its_rowcount_in_one_wait(pg_url: str) -> None:
    conn = postgres.connect(pg_url)
    try:
        conn.execute(TABLE)
        with conn.pipelined():
            conn.execute("BEGIN")
            before = conn.round_trips
            cursor = conn.executemany("INSERT INTO items (id, name) VALUES (?, ?)", [(1, "a"), (2, "b")])
            assert cursor.rowcount == 2
            assert conn.round_trips - before == 1
            with pytest.raises(psycopg.errors.IntegrityError):
                conn.executemany("INSERT INTO items (id, name) VALUES (?, ?)", [(3, "c"), (1, "again")])
            conn.execute("ROLLBACK")
    finally:
        conn.close()
    assert rows(pg_url) == []
