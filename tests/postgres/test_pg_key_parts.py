"""A PostgreSQL database from before on_enter keys were stored by their parts migrates (store/backends/
pg_schema.py migration 21): every run keeps its key, byte for byte, and the indexes are SQLite's."""

from __future__ import annotations

from typing import Any

import pytest
from key_parts_support import OLD_RUNS, T0

from onceflow.store.backends import pg_schema, postgres, schema
from onceflow.store.runs import keys


def _old_database(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Schema 20 holding `OLD_RUNS`."""
    conn = postgres.connect(url)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(pg_schema, "MIGRATIONS", pg_schema.MIGRATIONS[: 20 - pg_schema.BASELINE_VERSION])
            patch.setattr(pg_schema, "SCHEMA_VERSION", 20)
            patch.setattr(schema, "SCHEMA_VERSION", 20)
            assert pg_schema.migrate(conn) == 20
        conn.execute("BEGIN")
        conn.execute(
            "INSERT INTO workflows (id, name, source, definition, registered_at) VALUES ('w', 'w', '', '', 0)"
        )
        for task_id in ("T1", "T:1%"):
            conn.execute(
                "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
                " VALUES (?, 'w', 's', 0, 0)",
                (task_id,),
            )
        for run_id, task_id, step, seq, agent, key in OLD_RUNS:
            conn.execute(
                "INSERT INTO runs (id, agent_profile_id, task_id, workflow_step_id, reason, idempotency_key,"
                " requested_at, trigger, entry_seq, status, claim_token) OVERRIDING SYSTEM VALUE VALUES"
                " (?, ?, ?, ?, 'on_enter', ?, ?, 'on_enter', ?, 'finished', 'tok')",
                (run_id, agent, task_id, step, key, T0 + run_id, seq),
            )
        conn.execute("COMMIT")
    finally:
        conn.close()


def test_an_old_postgres_database_migrates_its_on_enter_keys_to_their_parts(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _old_database(pg_url, monkeypatch)
    conn = postgres.connect(pg_url)
    try:
        columns = (
            "id, agent_profile_id, task_id, workflow_step_id, entry_seq, requested_at, status, claim_token"
        )
        before = conn.execute(f"SELECT {columns} FROM runs ORDER BY id").fetchall()
        assert pg_schema.migrate(conn) == schema.SCHEMA_VERSION
        after: list[Any] = conn.execute(f"SELECT {columns} FROM runs ORDER BY id").fetchall()
        assert after == before
        read_back = conn.execute(f"SELECT id, {keys.STORED_KEY_SQL} FROM runs ORDER BY id").fetchall()
        assert [tuple(row) for row in read_back] == [(run_id, key) for run_id, *_, key in OLD_RUNS]
        by_parts = conn.execute(
            "SELECT id FROM runs WHERE idempotency_key IS NULL AND key_position IS NOT NULL ORDER BY id"
        ).fetchall()
        assert [row[0] for row in by_parts] == [1, 2]
        indexes = conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'runs'").fetchall()
        names = {row[0] for row in indexes}
        assert {"runs_by_key", "runs_by_entry_key"} <= names
        assert not {"runs_by_task", "runs_idempotency_key_key"} & names
    finally:
        conn.close()
