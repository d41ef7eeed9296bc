"""The store actor on a real PostgreSQL server: dialect, typed faults, task locks, epochs."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from typing import Any

import psycopg
import pytest
import trio

from onceflow.protocol.errors import StorageError
from onceflow.store import writer
from onceflow.store.backends import epochs, faults, pg_schema, postgres, schema
from onceflow.store.backends.dialect import dialect_of
from onceflow.store.entries import step_entries
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.writer import open_store


def _add_workflow(workflow_id: str) -> Any:
    def fn(conn: sqlite3.Connection) -> str:
        conn.execute(
            "INSERT INTO workflows (id, name, source, definition, registered_at)"
            " VALUES (?, 'w', 't', '{}', 0)",
            (workflow_id,),
        )
        return workflow_id

    return fn


def _seed_task(conn: sqlite3.Connection, task_id: str = "T") -> None:
    conn.execute(
        "INSERT INTO workflows (id, name, source, definition, registered_at) VALUES ('w', 'w', 't', '{}', 0)"
        " ON CONFLICT (id) DO NOTHING"
    )
    conn.execute(
        "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
        " VALUES (?, 'w', 's', 0, 0)",
        (task_id,),
    )


async def test_open_store_on_postgres_creates_the_schema_at_the_current_version(pg_url: str) -> None:
    async with open_store(pg_url) as store:
        assert store.postgres and "postgresql://" in str(store.path)
        version = await store.transact(
            lambda conn: conn.execute("SELECT version FROM onceflow_meta").fetchone()
        )
        assert version == (schema.SCHEMA_VERSION,) == (pg_schema.SCHEMA_VERSION,)
    async with open_store(pg_url) as store:  # reopening migrates nothing and keeps the data
        assert await store.transact(_add_workflow("w1")) == "w1"
    async with open_store(pg_url) as store:
        assert await store.transact(lambda conn: conn.execute("SELECT id FROM workflows").fetchall()) == [
            ("w1",)
        ]


async def test_postgres_schema_has_sqlites_tables_and_columns(pg_url: str, tmp_path: Any) -> None:
    """store/backends/pg_schema.py restates store/backends/schema.py for PostgreSQL: the two must not drift
    apart. Every table and column SQLite's migrations end with exists on PostgreSQL and the other way round
    (PostgreSQL adds only an explicit `rowid` where the store reads SQLite's implicit one, and its version
    table; SQLite alone has `run_minutes`, which bounds its hourly rate counts where PostgreSQL keeps an
    index, store/runs/flow.py)."""
    with contextlib.closing(sqlite3.connect(tmp_path / "s.db", isolation_level=None)) as lite:
        schema.migrate(lite)
        tables = [row[0] for row in lite.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        on_sqlite = {
            (table, column[1])
            for table in tables
            if not table.startswith("sqlite_")
            for column in lite.execute(f"PRAGMA table_info({table})")
        }
    async with open_store(pg_url) as store:
        rows = await store.transact(
            lambda conn: conn.execute(
                "SELECT table_name, column_name FROM information_schema.columns"
                " WHERE table_schema = current_schema()"
            ).fetchall()
        )
    # onceflow_test_clock: the tests' settable server clock (pg_support.TEST_SERVER_CLOCK), not the schema's
    on_postgres = {
        (table, column) for table, column in rows if table not in ("onceflow_meta", "onceflow_test_clock")
    }
    assert on_postgres - on_sqlite == {("step_entries", "rowid"), ("outcomes", "rowid")}
    assert on_sqlite - on_postgres == {("run_minutes", "minute"), ("run_minutes", "first_id")}


async def test_runtimes_starting_together_migrate_once(pg_url: str) -> None:
    opened: list[str] = []

    async def one() -> None:
        async with open_store(pg_url) as store:
            opened.append(store.epoch)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    assert len(set(opened)) == 3


async def test_dialect_returning_null_safe_is_and_bytes_text_factory(pg_url: str) -> None:
    insert = (
        "INSERT INTO runs (agent_profile_id, reason, requested_at, idempotency_key) VALUES (?, 'r', 0, ?)"
        " ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING id"
    )

    def fn(conn: sqlite3.Connection) -> tuple[Any, ...]:
        first = conn.execute(insert, ("a", "k1"))
        first_id = first.fetchone()[0]
        again = conn.execute(insert, ("a", "k1"))
        again_row = again.fetchone()
        same = dialect_of(conn).same
        null_match = conn.execute(f"SELECT id FROM runs WHERE task_id {same} ?", (None,)).fetchall()
        conn.text_factory = bytes
        try:
            as_bytes = conn.execute("SELECT agent_profile_id FROM runs").fetchone()
        finally:
            conn.text_factory = str
        percent = conn.execute("SELECT '5%' || ?", ("x",)).fetchone()
        return first_id, first.rowcount, again_row, again.rowcount, null_match, as_bytes, percent

    async with open_store(pg_url) as store:
        first_id, first_count, again_id, again_count, nulls, as_bytes, percent = await store.transact(fn)
    assert (first_count, again_id, again_count) == (1, None, 0)
    assert nulls == [(first_id,)]
    assert as_bytes == (b"a",)
    assert percent == ("5%x",)


async def test_a_constraint_violation_is_an_integrity_error_and_rolls_back_alone(pg_url: str) -> None:
    async with open_store(pg_url, max_batch=8) as store:
        await store.transact(_add_workflow("w1"))
        with pytest.raises(psycopg.errors.UniqueViolation):
            await store.transact(_add_workflow("w1"))
        assert await store.transact(_add_workflow("w2")) == "w2"  # the transaction survived the savepoint


async def test_a_read_only_transaction_is_storage_read_only(pg_url: str) -> None:
    def write_read_only(conn: sqlite3.Connection) -> None:
        conn.execute("SET TRANSACTION READ ONLY")
        _add_workflow("w")(conn)

    async with open_store(pg_url) as store:
        with pytest.raises(StorageError) as caught:
            await store.transact(write_read_only)
    assert caught.value.kind == "read_only" and not caught.value.retryable
    assert isinstance(caught.value.__cause__, psycopg.Error)


async def test_a_deadlock_is_storage_busy_and_retryable(pg_url: str) -> None:
    """Two sessions lock two rows in opposite orders; PostgreSQL aborts one with 40P01 → busy."""
    other = psycopg.connect(pg_url, autocommit=True)
    other.execute("SET deadlock_timeout = '20s'")  # the store's session runs the check, and loses
    try:
        async with open_store(pg_url) as store:
            await store.transact(lambda conn: _seed_task(conn, "A"))
            await store.transact(lambda conn: _seed_task(conn, "B"))
            other.execute("BEGIN")
            other.execute("UPDATE tasks SET title = 'o' WHERE id = 'B'")
            locked_a = threading.Event()

            def lock_a_then_b(conn: sqlite3.Connection) -> None:
                # the rowcount is waited for: pipelined, the UPDATE might not have reached the server yet
                assert conn.execute("UPDATE tasks SET title = 's' WHERE id = 'A'").rowcount == 1
                locked_a.set()
                conn.execute("UPDATE tasks SET title = 's' WHERE id = 'B'")

            def other_side() -> None:
                locked_a.wait(10)
                with contextlib.suppress(psycopg.errors.DeadlockDetected):
                    other.execute("UPDATE tasks SET title = 'o' WHERE id = 'A'")
                other.execute("ROLLBACK")

            thread = threading.Thread(target=other_side)
            thread.start()
            try:
                with pytest.raises(StorageError) as caught:
                    await store.transact(lock_a_then_b)
            finally:
                await trio.to_thread.run_sync(thread.join)
            assert caught.value.kind == "busy" and caught.value.retryable
            assert "40P01" in str(caught.value)
    finally:
        other.close()


async def test_a_lost_connection_is_storage_io_and_the_writer_renews_its_epoch(pg_url: str) -> None:
    admin = psycopg.connect(pg_url, autocommit=True)
    try:
        async with open_store(pg_url) as store:
            old = store.epoch
            pid = await store.transact(lambda conn: conn.execute("SELECT pg_backend_pid()").fetchone()[0])
            # wait_for: the backend is gone (its advisory locks with it), not only signalled.
            admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
            with pytest.raises(StorageError) as caught:
                await store.transact(_add_workflow("w1"))
            assert caught.value.kind == "io" and caught.value.retryable
            assert await store.transact(_add_workflow("w2")) == "w2"  # reconnected
            assert store.epoch != old
            # The old epoch died with its session; the new one is held.
            with admin.transaction():
                assert admin.execute(
                    "SELECT pg_try_advisory_xact_lock(%s)", (epochs.epoch_key(old),)
                ).fetchone()[0]
                assert not admin.execute(
                    "SELECT pg_try_advisory_xact_lock(%s)", (epochs.epoch_key(store.epoch),)
                ).fetchone()[0]
    finally:
        admin.close()


def test_engines_whose_advisory_locks_are_stubs_are_refused(pg_url: str) -> None:
    """verify_real_locks refuses a second 'session' that is granted a lock the first holds: here the same
    session, whose locks are re-entrant, stands in for a stub engine that grants every lock."""
    conn = postgres.connect(pg_url)
    other = postgres.connect(pg_url)
    try:
        epochs.verify_real_locks(conn, other)  # real locks: accepted
        with pytest.raises(epochs.AdvisoryLocksUnsupportedError, match="not exclusive"):
            epochs.verify_real_locks(conn, conn)
    finally:
        conn.close()
        other.close()


async def test_an_epoch_is_live_while_its_runtime_holds_the_connection(pg_url: str) -> None:
    probe = postgres.connect(pg_url)

    def live(epoch: str) -> bool:
        probe.execute("BEGIN")
        try:
            return epochs.is_live(probe, epoch)
        finally:
            probe.execute("ROLLBACK")

    try:
        async with open_store(pg_url) as store:
            epoch = store.epoch
            assert live(epoch)
        with trio.fail_after(5):  # closed: the session lock goes with the session, once the server sees it
            while live(epoch):
                await trio.sleep(0.01)
        assert not live("0" * 32)  # an epoch nobody holds
    finally:
        probe.close()


async def test_claim_marker_leaves_a_live_peers_claim_and_reclaims_a_dead_ones(pg_url: str) -> None:
    key = EntryKey("T", "s", 1)

    def seed(conn: sqlite3.Connection) -> None:
        _seed_task(conn)
        step_entries.allocate_entry(
            conn,
            task_id=key.task_id,
            step_id=key.step_id,
            workflow_id="w",
            digest="digest",
            entry_path="E1",
            now=0.0,
        )

    async with open_store(pg_url) as peer, open_store(pg_url) as me:
        await me.transact(seed)
        assert (
            await peer.transact(lambda c: step_entries.claim_marker(c, key, 0, "k", peer.epoch, 1.0))
            == "claimed"
        )
        # The peer is alive: its claim stands (SQLite would call any other epoch dead).
        assert (
            await me.transact(lambda c: step_entries.claim_marker(c, key, 0, "k", me.epoch, 2.0))
            == "live_peer"
        )
        peer_epoch = peer.epoch
    async with open_store(pg_url) as me:
        with trio.fail_after(5):  # the peer closed: its epoch is dead once the server has ended its session
            while (
                await me.transact(lambda c: step_entries.claim_marker(c, key, 0, "k", me.epoch, 3.0))
                != "claimed"
            ):
                await trio.sleep(0.01)
        marker = await me.transact(lambda c: step_entries.markers(c, key)[0])
        assert marker.epoch == me.epoch != peer_epoch


async def test_one_tasks_transactions_are_serialized_across_runtimes(pg_url: str) -> None:
    """Read-modify-write of one counter from two runtimes at once, every transaction in the task's scope:
    without the task lock READ COMMITTED loses updates; with it none is lost."""
    rounds = 40

    def bump(conn: sqlite3.Connection) -> None:
        (position,) = conn.execute("SELECT position FROM tasks WHERE id = 'T'").fetchone()
        conn.execute("SELECT pg_sleep(0.001)")  # widen the race window
        conn.execute("UPDATE tasks SET position = ? WHERE id = 'T'", (position + 1,))

    async with open_store(pg_url, max_batch=8) as a, open_store(pg_url, max_batch=8) as b:
        await a.transact(_seed_task)

        async def worker(store: Any) -> None:
            epochs.CURRENT_TASK.set("T")
            for _ in range(rounds):
                await store.transact(bump)

        async with trio.open_nursery() as nursery:
            for store in (a, b, a, b):
                nursery.start_soon(worker, store)
        total = await a.transact(
            lambda conn: conn.execute("SELECT position FROM tasks WHERE id = 'T'").fetchone()
        )
    assert total == (4 * rounds,)


async def test_a_batch_never_waits_for_a_task_held_by_another_runtime(pg_url: str) -> None:
    """Runtime B's batch is [task X, task T] while runtime A holds T's lock: X commits at once, T after A."""
    async with open_store(pg_url) as a, open_store(pg_url, max_batch=8) as b:
        await a.transact(_seed_task)
        await a.transact(lambda conn: _seed_task(conn, "X"))
        holding, release = threading.Event(), threading.Event()

        def hold_t(conn: sqlite3.Connection) -> None:
            holding.set()
            release.wait(10)

        done: list[str] = []

        async def in_task(store: Any, task_id: str, fn: Any) -> None:
            epochs.CURRENT_TASK.set(task_id)
            await store.transact(fn)
            done.append(task_id)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_task, a, "T", hold_t)
            await trio.to_thread.run_sync(holding.wait, 10)
            blocker_started, blocker_release = threading.Event(), threading.Event()

            def hold_writer(conn: sqlite3.Connection) -> None:  # queue B's next requests into one batch
                blocker_started.set()
                blocker_release.wait(10)

            nursery.start_soon(b.transact, hold_writer)
            await trio.to_thread.run_sync(blocker_started.wait, 10)
            nursery.start_soon(in_task, b, "X", lambda conn: None)
            await trio.sleep(0.05)
            nursery.start_soon(in_task, b, "T", lambda conn: None)
            await trio.sleep(0.05)
            blocker_release.set()
            with trio.fail_after(5):
                while "X" not in done:
                    await trio.sleep(0.01)
            assert done == ["X"]  # T (B's) still waits for A
            release.set()
        assert sorted(done) == ["T", "T", "X"]


async def test_an_idle_writer_heartbeats_and_renews_its_epoch_once_its_session_is_gone(
    pg_url: str,
) -> None:
    admin = psycopg.connect(pg_url, autocommit=True)
    try:
        async with open_store(pg_url) as store:
            old = store.epoch
            pid = await store.transact(lambda conn: conn.execute("SELECT pg_backend_pid()").fetchone()[0])
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            with trio.fail_after(10):  # no request is sent: the heartbeat finds the loss and reconnects
                while store.epoch == old:
                    await trio.sleep(0.05)
            with admin.transaction():
                assert not admin.execute(
                    "SELECT pg_try_advisory_xact_lock(%s)", (epochs.epoch_key(store.epoch),)
                ).fetchone()[0]
    finally:
        admin.close()


async def test_a_writer_without_a_round_trip_for_fence_after_seconds_is_fenced(
    pg_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer, "FENCE_AFTER", 0.2)
    started, release = threading.Event(), threading.Event()

    def stall(conn: sqlite3.Connection) -> None:
        started.set()
        release.wait(10)

    for target in (pg_url, tmp_path / "f.db"):
        async with open_store(target) as store, trio.open_nursery() as nursery:
            assert not store.fenced
            nursery.start_soon(store.transact, stall)
            await trio.to_thread.run_sync(started.wait, 10)
            await trio.sleep(0.4)
            assert store.fenced == store.postgres  # never on SQLite: no one else can take its epoch
            release.set()
        assert not store.fenced  # the commit was a round trip
        started.clear()
        release.clear()


async def test_a_task_lock_held_past_the_busy_timeout_is_storage_busy(pg_url: str) -> None:
    """busy_timeout is the lock wait on PostgreSQL too: a task locked by another runtime's open
    transaction fails the request as busy (retryable) once it has waited that long."""
    other = postgres.connect(pg_url)
    try:
        async with open_store(pg_url, busy_timeout=0.3) as store:
            await store.transact(_seed_task)
            other.execute("BEGIN")
            assert epochs.lock_tasks(other, ["T"]) == {"T": True}
            epochs.CURRENT_TASK.set("T")
            with pytest.raises(StorageError) as caught:
                await store.transact(lambda conn: None)
            assert caught.value.kind == "busy" and caught.value.retryable
            other.execute("ROLLBACK")
            assert await store.transact(lambda conn: "ran") == "ran"
    finally:
        other.close()


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (psycopg.errors.SerializationFailure("x"), "busy"),
        (psycopg.errors.DeadlockDetected("x"), "busy"),
        (psycopg.errors.LockNotAvailable("x"), "busy"),
        (psycopg.errors.DiskFull("x"), "full"),
        (psycopg.errors.OutOfMemory("x"), "out_of_memory"),
        (psycopg.errors.ReadOnlySqlTransaction("x"), "read_only"),
        (psycopg.errors.InsufficientPrivilege("x"), "read_only"),
        (psycopg.errors.AdminShutdown("x"), "io"),
        (psycopg.errors.ConnectionFailure("x"), "io"),
        (psycopg.OperationalError("server closed the connection unexpectedly"), "io"),
        (psycopg.errors.DataCorrupted("x"), "corrupt"),
        (psycopg.errors.UniqueViolation("x"), None),
        (psycopg.errors.SyntaxError("x"), None),
    ],
)
def test_postgres_errors_map_to_storage_kinds(error: psycopg.Error, kind: str | None) -> None:
    mapped = postgres.typed(error)
    assert faults.storage_kind(mapped) == kind
    assert (mapped is error) == (kind is None)  # anything but a storage fault stays psycopg's own
    assert faults.is_constraint_violation(mapped) == isinstance(error, psycopg.errors.IntegrityError)
