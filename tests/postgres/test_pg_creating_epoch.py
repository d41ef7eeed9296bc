"""Each step entry records the epoch of the runtime that created it (`step_entries.created_epoch`, migration
15), which the PostgreSQL sweep reads (store/backends/epochs.py `dead_epoch_entries`,
tests/postgres/test_pg_sweep.py): on PostgreSQL a column DEFAULT from the session setting `epochs.hold_epoch`
sets with the epoch's lock, kept through a session's reset and replaced with the epoch when the writer renews
it; NULL for the entries from before the migration, and on SQLite, where no sweep reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from onceflow.protocol.errors import StorageError
from onceflow.store.backends import epochs, pg_schema, postgres
from onceflow.store.backends.connection import Connection
from onceflow.store.entries import step_entries
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.writer import open_store


def _seed(conn: Connection) -> None:
    conn.execute(
        "INSERT INTO workflows (id, name, source, definition, registered_at) VALUES ('w', 'w', 't', '{}', 0)"
    )
    conn.execute(
        "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
        " VALUES ('T', 'w', 's', 0, 0)"
    )


def _enter(conn: Connection) -> EntryKey:
    return step_entries.allocate_entry(
        conn, task_id="T", step_id="s", workflow_id="w", digest="d", entry_path="E2", now=0.0
    )


def _created_epoch(conn: Connection, key: EntryKey) -> Any:
    row = conn.execute(
        "SELECT created_epoch FROM step_entries WHERE task_id = ? AND step_id = ? AND entry_seq = ?",
        (key.task_id, key.step_id, key.entry_seq),
    ).fetchone()
    assert row is not None
    return row[0]


async def test_ac_b9_an_entry_records_its_writers_epoch_after_a_failed_transaction_and_a_renewal(
    pg_url: str,
) -> None:
    """Every entry a writer inserts carries the epoch it holds: also after a failed transaction (its
    session reset: ROLLBACK, DEALLOCATE ALL) and, after its connection was lost, the renewed epoch."""
    admin = psycopg.connect(pg_url, autocommit=True)
    try:
        async with open_store(pg_url) as store:
            old = store.epoch
            await store.transact(_seed)
            first = await store.transact(_enter)
            assert await store.transact(_created_epoch, first) == old
            with pytest.raises(
                psycopg.errors.IntegrityError
            ):  # a failed pipelined batch: the session is reset
                await store.transact(_seed)
            second = await store.transact(_enter)
            assert await store.transact(_created_epoch, second) == old
            pid = await store.transact(lambda conn: conn.execute("SELECT pg_backend_pid()").fetchone()[0])
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            with pytest.raises(StorageError):
                await store.transact(_enter)
            third = await store.transact(_enter)  # on a fresh connection, under a new epoch
            assert store.epoch != old
            assert await store.transact(_created_epoch, third) == store.epoch
            assert await store.transact(_created_epoch, first) == old
    finally:
        admin.close()


def test_ac_b9_a_sessions_reset_keeps_its_epoch_setting(pg_url: str) -> None:
    """`PgConnection.reset` (after a fault) leaves the session's epoch setting as `hold_epoch` set it, so
    the entries inserted after it still record the epoch."""
    conn = postgres.connect(pg_url)
    try:
        assert conn.scalar("SELECT current_setting(?, true)", (epochs.EPOCH_SETTING,)) is None
        epochs.hold_epoch(conn, "e" * 32)
        conn.execute("BEGIN")
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1 / 0")
        conn.reset()
        assert not conn.reset_needed
        assert conn.scalar("SELECT current_setting(?)", (epochs.EPOCH_SETTING,)) == "e" * 32
    finally:
        conn.close()


async def test_ac_b9_migration_15_leaves_the_entries_from_before_of_unknown_epoch(pg_url: str) -> None:
    """A database at version 14 with an open entry, upgraded by a runtime holding its epoch: the entry from
    before has no creating epoch (NULL: the sweep's grace rule), not the migrating runtime's; an entry
    created after the upgrade has the writer's."""
    with psycopg.connect(pg_url, autocommit=True) as raw, raw.transaction():
        raw.execute(pg_schema.BASELINE)
        raw.execute(pg_schema.MIGRATIONS[0])  # 13
        raw.execute(pg_schema.MIGRATIONS[1])  # 14
        raw.execute("CREATE TABLE onceflow_meta (version BIGINT NOT NULL)")
        raw.execute("INSERT INTO onceflow_meta (version) VALUES (14)")
        raw.execute(
            "INSERT INTO workflows (id, name, source, definition, registered_at)"
            " VALUES ('w', 'w', 't', '{}', 0)"
        )
        raw.execute(
            "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
            " VALUES ('T', 'w', 's', 0, 0)"
        )
        raw.execute(
            "INSERT INTO step_entries (task_id, step_id, entry_seq, workflow_id, declaration_digest,"
            " entry_path, terminal, created_at) VALUES ('T', 's', 1, 'w', 'd', 'E2', 0, 0)"
        )
    async with open_store(pg_url) as store:
        version = await store.transact(
            lambda conn: conn.execute("SELECT version FROM onceflow_meta").fetchone()
        )
        assert version == (pg_schema.SCHEMA_VERSION,)
        assert await store.transact(_created_epoch, EntryKey("T", "s", 1)) is None
        after = await store.transact(_enter)
        assert after == EntryKey("T", "s", 2)
        assert await store.transact(_created_epoch, after) == store.epoch


async def test_ac_b9_on_sqlite_an_entry_records_no_creating_epoch(tmp_path: Path) -> None:
    """SQLite has the column (the schemas stay equal) but leaves it NULL: one runtime owns the file and
    its start-up scan finishes what a dead one left; no sweep reads it."""
    async with open_store(tmp_path / "s.db") as store:
        await store.transact(_seed)
        key = await store.transact(_enter)
        assert await store.transact(_created_epoch, key) is None
