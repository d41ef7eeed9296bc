"""Migration 23 (store/backends/schema.py): fewer bytes per step entry, and every old row still reads as it
did — the done markers written with their entry move onto its row, digests are kept once, a trigger equal to
its run's reason is stored as '', and the hourly rate's minutes are filled from the runs there are."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from onceflow.store.backends import schema
from onceflow.store.entries import step_entries
from onceflow.store.runs import flow, keys, runs

DIGEST = step_entries.declaration_digest(["clear_decisions", "queue_run_for_each_participant"])
KEY = keys.entry_key("T1", "review", 1, 1, "rev-a", "0123456789abcdef")


def _at_22(path: Path, monkeypatch: pytest.MonkeyPatch) -> sqlite3.Connection:
    """A database at schema 22: two entries (the first's markers both done with it, the second's failed
    with a detail), an on_enter run by its key's parts and a run of another trigger."""
    with monkeypatch.context() as patch:
        patch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:22])
        patch.setattr(schema, "SCHEMA_VERSION", 22)
        conn = sqlite3.connect(path, isolation_level=None)
        assert schema.migrate(conn) == 22
    conn.execute(
        "INSERT INTO workflows (id, name, source, definition, registered_at) VALUES ('w', 'w', '', '', 0)"
    )
    conn.execute(
        "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
        " VALUES ('T1', 'w', 'review', 0, 0)"
    )
    for seq, at in ((1, 5.0), (2, 7.0)):
        conn.execute(
            "INSERT INTO step_entries (task_id, step_id, entry_seq, workflow_id, declaration_digest,"
            " entry_path, terminal, created_at) VALUES ('T1', 'review', ?, 'w', ?, 'E2', 1, ?)",
            (seq, DIGEST, at),
        )
    markers = [
        (1, 0, "clear_decisions", "done", "", 5.0),
        (1, 1, "queue_run_for_each_participant", "done", "", 5.0),
        (2, 0, "clear_decisions", "done", "", 7.0),
        (2, 1, "queue_run_for_each_participant", "failed", "attempted=1 failed=1", 7.0),
    ]
    conn.executemany(
        "INSERT INTO step_entry_markers (task_id, step_id, entry_seq, position, kind, state, epoch, detail,"
        " updated_at) VALUES ('T1', 'review', ?, ?, ?, ?, NULL, ?, ?)",
        markers,
    )
    conn.execute(
        "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, requested_at, trigger,"
        " entry_seq, key_position, key_digest)"
        " VALUES ('rev-a', 'T1', 'review', 'on_enter', 120.5, 'on_enter', 1, 1, '0123456789abcdef')"
    )
    conn.execute(
        "INSERT INTO runs (agent_profile_id, task_id, reason, requested_at, trigger)"
        " VALUES ('rev-a', 'T1', 'ping', 130.0, 'on_exit')"
    )
    return conn


def test_migration_23_keeps_what_every_entry_and_run_reads_as(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = _at_22(tmp_path / "old.db", monkeypatch)
    assert schema.migrate(conn) == schema.SCHEMA_VERSION
    entries = step_entries.entries_with_markers(conn, "T1")
    assert [(e["entry_seq"], e["declaration_digest"], e["terminal"]) for e in entries] == [
        (1, DIGEST, True),
        (2, DIGEST, True),
    ]
    shown = [
        [(m["position"], m["kind"], m["state"], m["epoch"], m["detail"]) for m in e["markers"]]
        for e in entries
    ]
    assert shown == [
        [(0, "clear_decisions", "done", None, ""), (1, "queue_run_for_each_participant", "done", None, "")],
        [
            (0, "clear_decisions", "done", None, ""),
            (1, "queue_run_for_each_participant", "failed", None, "attempted=1 failed=1"),
        ],
    ]
    # the first entry's markers are on its row; the second keeps its rows (one has a detail)
    stored = conn.execute("SELECT entry_seq, done_markers FROM step_entries ORDER BY entry_seq").fetchall()
    assert stored == [(1, "c0f1"), (2, None)]
    assert conn.execute("SELECT COUNT(*) FROM step_entry_markers").fetchone() == (2,)
    assert conn.execute("SELECT COUNT(*) FROM digests").fetchone() == (2,)  # one declaration, one config
    on_enter, other = runs.get_run(conn, 1), runs.get_run(conn, 2)
    assert on_enter is not None and other is not None
    assert (on_enter.trigger, on_enter.idempotency_key, other.trigger) == ("on_enter", KEY, "on_exit")
    assert conn.execute("SELECT trigger FROM runs ORDER BY id").fetchall() == [("",), ("on_exit",)]
    assert conn.execute("SELECT minute, first_id FROM run_minutes ORDER BY minute").fetchall() == [(2, 1)]


def test_the_hourly_count_reads_every_run_of_the_last_hour_by_its_minutes(tmp_path: Path) -> None:
    """SQLite counts `runs_per_hour` over the run ids `run_minutes` bounds, which its triggers keep also when
    a run's `requested_at` moves (here an hour on: its first minute is then out of the window)."""
    conn = sqlite3.connect(tmp_path / "new.db", isolation_level=None)
    schema.migrate(conn)
    for at in (10.0, 4000.0, 4100.0):
        conn.execute("INSERT INTO runs (agent_profile_id, reason, requested_at) VALUES ('a', 'r', ?)", (at,))
    conn.execute("UPDATE runs SET requested_at = 4150.0 WHERE id = 1")
    conn.execute("INSERT INTO runs (agent_profile_id, reason, requested_at) VALUES ('b', 'r', 4200.0)")
    now = 4201.0
    by_agent = conn.execute(flow._AGENT_HOUR.sqlite, (now, "a", flow.RATE_WINDOW)).fetchone()[0]
    everyone = conn.execute(flow._ALL_HOUR.sqlite, (now, flow.RATE_WINDOW)).fetchone()[0]
    assert (by_agent, everyone) == (3, 4)
