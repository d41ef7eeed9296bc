"""On_enter idempotency keys stored by their parts (store/runs/keys.py; store/backends/schema.py migration
21): a run gives back its key byte for byte, a key held in either form suppresses the other (AC-B4, AC-H6),
and a database written before the change migrates with every run and key it had."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from key_parts_support import OLD_RUNS, T0

from onceflow.store.backends import schema
from onceflow.store.runs import keys, runs
from onceflow.store.runs.runs import RunRequest
from onceflow.store.writer import open_store


def _entry_request(key: str, seq: int = 1) -> RunRequest:
    """As an on_enter fan-out enqueues its run: excluded from coalescing (AC-H9)."""
    return RunRequest(
        "rev:a",
        "T:1%",
        "review",
        "on_enter",
        idempotency_key=key,
        exclude_from_coalescing=True,
        trigger="on_enter",
        entry_seq=seq,
    )


async def _tasks(store: Any) -> None:
    def fn(conn: sqlite3.Connection) -> None:
        conn.execute(
            "INSERT INTO workflows (id, name, source, definition, registered_at) VALUES ('w', 'w', '', '', 0)"
        )
        conn.execute(
            "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
            " VALUES ('T:1%', 'w', 'review', 0, 0)"
        )

    await store.transact(fn)


async def test_an_on_enter_run_stores_its_key_by_its_parts_and_gives_it_back(db_path: Path | str) -> None:
    key = keys.entry_key("T:1%", "review", 1, 2, "rev:a", "0123456789abcdef")
    async with open_store(db_path) as store:
        await _tasks(store)
        queued = await store.transact(lambda conn: runs.enqueue_run(conn, _entry_request(key), T0))
        stored = await store.transact(
            lambda conn: conn.execute(
                "SELECT idempotency_key, key_position, (SELECT digest FROM digests WHERE id = key_digest)"
                " FROM runs WHERE id = ?",
                (queued.run_id,),
            ).fetchone()
        )
        run = await store.transact(lambda conn: runs.get_run(conn, queued.run_id))
    assert queued.outcome == "queued"
    assert tuple(stored) == (None, 2, "0123456789abcdef")
    assert run is not None and run.idempotency_key == key


@pytest.mark.parametrize("first_by_parts", [True, False], ids=["parts-then-text", "text-then-parts"])
async def test_an_on_enter_key_held_in_either_form_suppresses_the_other(
    db_path: Path | str, first_by_parts: bool
) -> None:
    """The same key from the entry's own run (stored by its parts) and from a run of another trigger (no
    entry_seq: stored as text) is one key: whichever comes second is suppressed, naming the first run."""
    key = keys.entry_key("T:1%", "review", 1, 0, "rev:a", "0123456789abcdef")
    by_parts = _entry_request(key)
    as_text = RunRequest(
        "rev:a", "T:1%", "review", "other", idempotency_key=key, exclude_from_coalescing=True
    )
    first, second = (by_parts, as_text) if first_by_parts else (as_text, by_parts)
    async with open_store(db_path) as store:
        await _tasks(store)
        one = await store.transact(lambda conn: runs.enqueue_run(conn, first, T0))
        two = await store.transact(lambda conn: runs.enqueue_run(conn, second, T0 + 1))
        count = await store.transact(lambda conn: conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
    assert (one.outcome, two.outcome, two.run_id, count) == ("queued", "suppressed", one.run_id, 1)


def _old_database(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database at schema 20 holding `OLD_RUNS`, its AUTOINCREMENT mark at 100 (run 100 since deleted)."""
    with monkeypatch.context() as patch:
        patch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:20])
        patch.setattr(schema, "SCHEMA_VERSION", 20)
        conn = sqlite3.connect(path, isolation_level=None)
        assert schema.migrate(conn) == 20
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
            " requested_at, trigger, entry_seq, status, claim_token) VALUES (?, ?, ?, ?, 'on_enter', ?, ?,"
            " 'on_enter', ?, 'finished', 'tok')",
            (run_id, agent, task_id, step, key, T0 + run_id, seq),
        )
    conn.execute("INSERT INTO runs (id, agent_profile_id, reason, requested_at) VALUES (100, 'x', 'r', 0)")
    conn.execute("DELETE FROM runs WHERE id = 100")
    conn.close()


def test_an_old_database_migrates_its_on_enter_keys_to_their_parts_and_keeps_every_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "old.db"
    _old_database(path, monkeypatch)
    conn = sqlite3.connect(path, isolation_level=None)
    columns = "id, agent_profile_id, task_id, workflow_step_id, entry_seq, requested_at, status, claim_token"
    before = conn.execute(f"SELECT {columns} FROM runs ORDER BY id").fetchall()
    assert schema.migrate(conn) == schema.SCHEMA_VERSION
    assert conn.execute(f"SELECT {columns} FROM runs ORDER BY id").fetchall() == before
    read_back = conn.execute(f"SELECT id, {keys.STORED_KEY_SQL} FROM runs ORDER BY id").fetchall()
    assert read_back == [(run_id, key) for run_id, *_, key in OLD_RUNS]
    by_parts = conn.execute("SELECT id FROM runs WHERE idempotency_key IS NULL AND key_position IS NOT NULL")
    assert [run_id for (run_id,) in by_parts] == [1, 2]  # 5 repeats 1's (entry, position, agent): text
    digest = "(SELECT digest FROM digests WHERE id = key_digest)"  # migration 23: kept once
    assert conn.execute(f"SELECT key_position, {digest} FROM runs WHERE id = 2").fetchone() == (
        0,
        "fedcba9876543210",
    )
    indexes = {name for (name,) in conn.execute("SELECT name FROM sqlite_schema WHERE tbl_name = 'runs'")}
    assert {"runs_by_key", "runs_by_entry_key"} <= indexes and "runs_by_task" not in indexes
    with pytest.raises(sqlite3.IntegrityError):  # one run per (entry, position, agent)
        conn.execute(
            "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, requested_at, entry_seq,"
            " key_position, key_digest) VALUES ('rev-a', 'T1', 'review', 'r', 0, 1, 1, 'x')"
        )
    new_id = conn.execute(
        "INSERT INTO runs (agent_profile_id, reason, requested_at) VALUES ('x', 'r', 0)"
    ).lastrowid
    assert new_id == 101  # no run id reused: the AUTOINCREMENT mark survived the rebuild
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    conn.close()
